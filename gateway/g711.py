"""ITU-T G.711 companding: 16-bit linear PCM to 8-bit mu-law (North America, Japan) and A-law (the rest of
the world), the telephone network's two codecs. Each code is a sign bit, a 3-bit segment (a power-of-two range
of magnitudes) and a 4-bit step within the segment, so the step size doubles from one segment to the next.

Encoding follows the standard's segment tables as ITU-T G.191's reference software and Sun's ``g711.c``
apply them (which is what ``audioop`` did): mu-law quantizes 14 bits (the 16-bit input >> 2) with a bias of 33
and inverts every bit; A-law quantizes 13 bits (>> 3), takes negative magnitudes as the one's complement,
and inverts the even bits (XOR 0x55). Silence is 0xFF in mu-law and 0xD5 in A-law.
"""

from __future__ import annotations

import numpy as np

MULAW_BIAS = 33  # added to the 14-bit magnitude, so that segment k starts at 2**(k+5)
# the largest biased magnitude in each of mu-law's 8 segments (14-bit units)
MULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
# the largest magnitude in each of A-law's 8 segments (13-bit units); segments 0 and 1 share one step size
ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
ALAW_EVEN_BITS = 0x55  # A-law inverts bits 0, 2, 4 and 6 on the line


def _as_int(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.dtype != np.int16:
        raise ValueError(f"G.711 encodes 16-bit samples, got {samples.dtype}")
    return samples.astype(np.int32)


def mulaw_encode(samples: np.ndarray) -> np.ndarray:
    """16-bit linear samples (N,) int16 -> mu-law codes (N,) uint8."""
    x = _as_int(samples) >> 2  # 14 bits, rounded toward minus infinity as an arithmetic shift does
    negative = x < 0
    # beyond the last segment, the loudest code (14-bit magnitudes 8158 and up)
    magnitude = np.minimum(np.abs(x) + MULAW_BIAS, MULAW_SEGMENT_ENDS[-1])
    segment = np.searchsorted(MULAW_SEGMENT_ENDS, magnitude)  # 0..7: the first segment that holds it
    step = (magnitude >> (segment + 1)) & 0x0F
    code = (segment << 4) | step
    return (np.where(negative, 0x7F, 0xFF) ^ code).astype(np.uint8)


def alaw_encode(samples: np.ndarray) -> np.ndarray:
    """16-bit linear samples (N,) int16 -> A-law codes (N,) uint8."""
    x = _as_int(samples) >> 3  # 13 bits
    negative = x < 0
    magnitude = np.where(negative, -x - 1, x)  # one's complement: -1 and 0 share the smallest step
    segment = np.searchsorted(ALAW_SEGMENT_ENDS, magnitude)  # 0..7: 13 bits never pass the last
    step = (magnitude >> np.maximum(segment, 1)) & 0x0F
    code = (segment << 4) | step
    sign = np.where(negative, 0, 0x80)
    return ((sign | code) ^ ALAW_EVEN_BITS).astype(np.uint8)
