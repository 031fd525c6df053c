"""G.711 mu-law and A-law (gateway/g711.py) against the standard: every 16-bit value against an independent
implementation (CPython's ``audioop``, Sun's g711.c, while Python still ships it), the codes the standard
fixes for silence and full scale, and decoding with the standard's reconstruction levels (written here)
within half a quantization step."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gateway.g711 import alaw_encode, mulaw_encode

ALL = np.arange(-32768, 32768, dtype=np.int16)


def mulaw_decode(codes: np.ndarray) -> np.ndarray:
    """G.711 mu-law reconstruction in 16-bit units: ((2 x step + 33) << segment) - 33, times 4."""
    c = ~codes.astype(np.int32) & 0xFF
    segment, step = (c >> 4) & 7, c & 0x0F
    magnitude = (((step << 1) + 33) << segment) - 33  # 14-bit units, the middle of the step
    return np.where(c & 0x80, -magnitude, magnitude) * 4


def alaw_decode(codes: np.ndarray) -> np.ndarray:
    """G.711 A-law reconstruction in 16-bit units (the middle of each step; segments 0 and 1 share a step)."""
    c = codes.astype(np.int32) ^ 0x55
    segment, step = (c >> 4) & 7, c & 0x0F
    magnitude = np.where(segment == 0, (step << 1) + 1, ((step << 1) + 33) << np.maximum(segment - 1, 0))
    return np.where(c & 0x80, magnitude, -magnitude) * 8  # 13-bit units -> 16


@pytest.fixture(scope="module")
def audioop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("audioop")  # removed in Python 3.13


def test_every_sample_as_sun_g711_codes_it(audioop):
    assert np.array_equal(mulaw_encode(ALL), np.frombuffer(audioop.lin2ulaw(ALL.tobytes(), 2), np.uint8))
    assert np.array_equal(alaw_encode(ALL), np.frombuffer(audioop.lin2alaw(ALL.tobytes(), 2), np.uint8))


@pytest.mark.parametrize(
    ("encode", "table"),
    [
        (mulaw_encode, {0: 0xFF, 32767: 0x80, -32768: 0x00, 8: 0xFE, -8: 0x7E}),
        (alaw_encode, {0: 0xD5, -1: 0x55, 32767: 0xAA, -32768: 0x2A, 16: 0xD4}),
    ],
)
def test_the_codes_the_standard_fixes(encode, table):
    """Silence (0xFF / 0xD5), full scale, and the first step above silence."""
    samples = np.array(list(table), np.int16)
    assert [int(c) for c in encode(samples)] == list(table.values())


# codec, its decoder, its step in 16-bit units for a segment, and what the input shift drops (>> 2, >> 3)
CODECS = [
    (mulaw_encode, mulaw_decode, lambda segment: 8 << segment, 4),
    (alaw_encode, alaw_decode, lambda segment: 16 << np.maximum(segment - 1, 0), 8),
]


@pytest.mark.parametrize(("encode", "decode", "step", "dropped"), CODECS)
def test_decoding_is_within_half_a_step(encode, decode, step, dropped):
    codes = encode(ALL)
    decoded = decode(codes)
    assert np.all(np.diff(decoded) >= 0)  # a companding quantizer is monotonic
    assert len(np.unique(codes)) == 256 - (encode is mulaw_encode)  # mu-law has two zeros: 0x7F, 0xFF
    x = ALL.astype(np.int64)
    top = decoded.max()  # the loudest level: beyond it the codec saturates
    inside = np.abs(x) <= top
    segment = (codes.astype(np.int32) ^ (0xFF if encode is mulaw_encode else 0x55)) >> 4 & 7
    bound = step(segment) // 2 + dropped
    assert np.all(np.abs(decoded - x)[inside] <= bound[inside])
    assert np.all(np.abs(decoded[~inside]) == top) and top > 32000


@pytest.mark.parametrize(("encode", "decode"), [(mulaw_encode, mulaw_decode), (alaw_encode, alaw_decode)])
def test_speech_level_snr_is_g711s(encode, decode):
    """A sine at -10 dBFS comes back at G.711's ~38 dB signal-to-noise ratio (linear 8 bits would give ~40 dB
    only at full scale and ~30 dB here)."""
    t = np.arange(8000) / 8000
    x = np.round(32767 * 10 ** (-10 / 20) * np.sin(2 * np.pi * 1004 * t)).astype(np.int16)
    noise = decode(encode(x)) - x.astype(np.int64)
    snr = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum(noise.astype(np.float64) ** 2))
    assert 35 < snr < 42


def test_only_16_bit_samples():
    with pytest.raises(ValueError, match="16-bit"):
        mulaw_encode(np.zeros(4, np.float32))
