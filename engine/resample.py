"""Resampling of mono float32 audio (N,): the reference's windowed-sinc resampler, or libsoxr.

``resample_sinc`` uses torch, imported when first called. Sample rates are in Hz.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import soxr

from engine.audio import as_mono_float32

if TYPE_CHECKING:
    import torch

SINC_LOWPASS_WIDTH = 6
"""Zero crossings of the windowed sinc on each side of a tap, at the lower of the two rates."""

SINC_ROLLOFF = 0.99
"""Cutoff of the sinc resampler as a fraction of the lower rate's Nyquist frequency."""

SINC_KERNEL_LIMIT = 1 << 17
"""Most taps (float32, 512 KiB) of a sinc filter bank that :func:`resample` builds; a pair of rates whose bank
is larger goes through libsoxr. The bank has ``new x (orig + 2 * half_width)`` taps for the rates divided by
their gcd, so it grows with the product of coprime rates: 8009 -> 24000 Hz needs 192 M taps (and took 14.7 s
and 4 GB), 191999 -> 24000 Hz 4.6 G. Every rate a recording is commonly made at has a small one (11025 Hz,
the largest: 51,520 taps; 44.1 kHz 13,680; 16 and 48 kHz under 50), so those keep the reference's exact
math; under this limit a bank also costs at most ~1,060 multiply-adds per output sample."""


def _sinc_kernel(orig: int, new: int, dtype) -> tuple[torch.Tensor, int]:
    """Polyphase filter bank of the Hann-windowed sinc resampler, for rates already divided by their gcd.

    Returns (kernel, half_width): kernel has shape (new, 1, 2 * half_width + orig); row j holds the
    taps that make output sample j of each block of `new` outputs from a window of input samples.
    """
    import torch

    cutoff = min(orig, new) * SINC_ROLLOFF  # in units of the reduced rates
    half_width = math.ceil(SINC_LOWPASS_WIDTH * orig / cutoff)
    # Time of each input tap relative to each output phase, in input periods, then scaled so
    # the sinc's zero crossings land on integers. The operation order is kept as in torchaudio
    # so that the float32 taps come out identical.
    taps = torch.arange(-half_width, half_width + orig, dtype=dtype)[None, None] / orig
    phases = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new
    x = (phases + taps) * cutoff
    x = x.clamp(-SINC_LOWPASS_WIDTH, SINC_LOWPASS_WIDTH)
    hann = torch.cos(x * math.pi / SINC_LOWPASS_WIDTH / 2) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.ones((), dtype=dtype), torch.sin(x) / x)
    return sinc * (hann * (cutoff / orig)), half_width


def sinc_kernel_size(sr_in: int, sr_out: int) -> int:
    """Taps of the filter bank :func:`resample_sinc` builds for these rates (Hz)."""
    g = math.gcd(int(sr_in), int(sr_out))
    orig, new = int(sr_in) // g, int(sr_out) // g
    half_width = math.ceil(SINC_LOWPASS_WIDTH * orig / (min(orig, new) * SINC_ROLLOFF))
    return new * (2 * half_width + orig)


def resample_sinc(audio: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling with a Hann-windowed sinc, equivalent to the reference's resampler.

    Same algorithm as ``torchaudio.functional.resample(x, sr_in, sr_out)`` with its defaults
    (``sinc_interp_hann``, lowpass_filter_width 6, rolloff 0.99), which FireRedTTS3 uses on
    reference audio: the rates are divided by their gcd, a polyphase bank of `sr_out / g` filters is
    built, the input is zero-padded and convolved with a stride of `sr_in / g`, and the interleaved
    phases are cut to ceil(sr_out * N / sr_in) samples. Computed in float32, as torchaudio does for
    a float32 waveform. Imports torch on first use.

    Returns the input (as float32) when the rates are equal.
    """
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive, got {sr_in} -> {sr_out}")
    audio = as_mono_float32(audio)
    if sr_in == sr_out:
        return audio

    import torch

    g = math.gcd(int(sr_in), int(sr_out))
    orig, new = int(sr_in) // g, int(sr_out) // g
    n = audio.shape[0]
    kernel, half_width = _sinc_kernel(orig, new, torch.float32)
    x = torch.from_numpy(np.ascontiguousarray(audio))[None, None]
    x = torch.nn.functional.pad(x, (half_width, half_width + orig))
    with torch.inference_mode():
        phases = torch.nn.functional.conv1d(x, kernel, stride=orig)  # (1, new, blocks)
    out = phases[0].T.reshape(-1)  # block by block, phase by phase
    out_len = math.ceil(new * n / orig)
    return out[:out_len].numpy().astype(np.float32, copy=True)


def resample(audio: np.ndarray, sr_in: int, sr_out: int, method: str = "sinc") -> np.ndarray:
    """Resamples mono audio.

    Args:
        audio: float samples, shape (N,).
        sr_in, sr_out: rates in Hz.
        method: "sinc" (default): `resample_sinc`, the reference's windowed-sinc resampler
            (torchaudio's default), which prompt encoding and the speaker embedding need to
            match the reference; output has ceil(N * sr_out / sr_in) samples.
            "soxr": libsoxr at 'VHQ' quality, round(N * sr_out / sr_in) samples, no added delay;
            differs from the reference slightly near Nyquist.

    Returns the input (as float32) when the rates are equal, whatever the method.
    """
    if method not in ("sinc", "soxr"):
        raise ValueError(f"unknown resampling method {method!r}; expected 'sinc' or 'soxr'")
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive, got {sr_in} -> {sr_out}")
    audio = as_mono_float32(audio)
    if sr_in == sr_out:
        return audio
    if method == "sinc" and sinc_kernel_size(sr_in, sr_out) <= SINC_KERNEL_LIMIT:
        return resample_sinc(audio, sr_in, sr_out)
    out = soxr.resample(audio, sr_in, sr_out, quality="VHQ").astype(np.float32, copy=False)
    if method == "soxr":
        return out
    n = -(-int(sr_out) * audio.shape[0] // int(sr_in))  # the sinc path's length, ceil(N * sr_out / sr_in)
    return np.pad(out[:n], (0, max(0, n - out.shape[0])))
