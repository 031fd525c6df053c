"""iSTFT: exact reconstruction of a signal from its STFT, and streaming equal to one-shot."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.spectral import StreamingISTFT, hann_window, spectrum_to_frames

N_FFT, HOP = 1920, 480


def stft_same(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Analysis STFT whose frame f covers samples [f*hop - pad, f*hop - pad + n_fft)."""
    pad = (N_FFT - HOP) // 2
    xp = torch.nn.functional.pad(x, (pad, N_FFT))
    segs = xp.unfold(-1, N_FFT, HOP)[:, :frames] * hann_window(N_FFT)
    return torch.fft.rfft(segs, dim=-1)


def test_stft_istft_reconstructs():
    t = torch.arange(HOP * 40) / 24000
    x = (
        0.05 * torch.sin(2 * math.pi * 440 * t)
        + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
    )[None]
    spec = stft_same(x, 40)
    frames = spectrum_to_frames(torch.log(spec.abs().clamp_min(1e-12)), torch.angle(spec), N_FFT, hann_window(N_FFT))
    ist = StreamingISTFT(1, N_FFT, HOP)
    y = torch.cat([ist.push(frames), ist.flush()], dim=1)
    assert y.shape == x.shape
    # magnitudes stay below the head's exp clip (100); the last samples lack the frames after them
    np.testing.assert_allclose(y[0, : -HOP * 2].numpy(), x[0, : -HOP * 2].numpy(), atol=1e-5)


def test_streaming_istft_is_bit_identical_to_one_shot():
    g = torch.Generator().manual_seed(1)
    frames = torch.randn(1, 37, N_FFT, generator=g)
    one = StreamingISTFT(1, N_FFT, HOP)
    ref = torch.cat([one.push(frames), one.flush()], dim=1)
    st = StreamingISTFT(1, N_FFT, HOP)
    parts = [st.push(frames[:, a:b]) for a, b in ((0, 1), (1, 7), (7, 7), (7, 30), (30, 37))]
    out = torch.cat(parts + [st.flush()], dim=1)
    assert out.shape == (1, 37 * HOP)
    assert torch.equal(out, ref)
