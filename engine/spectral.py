"""Inverse STFT as streamable overlap-add.

The RedAE decoder emits one spectrum per 480-sample hop; each becomes a 1920-sample windowed frame.
Offline decoding is a single :meth:`StreamingISTFT.push` followed by :meth:`flush`, so streaming and
offline share one code path and add every frame's contribution in the same order (bit-identical).
Geometry ("same" padding): frames start every ``hop`` samples, the first ``pad = (n_fft - hop) / 2``
samples are trimmed, and T frames yield exactly T * hop samples.
"""

from __future__ import annotations

import copy

import torch


def hann_window(n: int, device=None) -> torch.Tensor:
    """Periodic Hann window (torch.hann_window's default)."""
    return torch.hann_window(n, periodic=True, device=device, dtype=torch.float32)


def spectrum_to_frames(log_mag: torch.Tensor, phase: torch.Tensor, n_fft: int, window: torch.Tensor):
    """(B, T, n_fft/2+1) log-magnitude and phase -> (B, T, n_fft) windowed time frames (float32)."""
    mag = torch.clip(torch.exp(log_mag.float()), max=1e2)
    spec = torch.complex(mag * torch.cos(phase.float()), mag * torch.sin(phase.float()))
    return torch.fft.irfft(spec, n=n_fft, dim=-1, norm="backward") * window


class StreamingISTFT:
    """Overlap-add state of B streams: push frames, get the samples that no later frame will touch."""

    def __init__(self, batch: int, n_fft: int, hop: int, device=None):
        if n_fft % hop:
            raise ValueError(f"n_fft ({n_fft}) must be a multiple of hop ({hop})")
        self.n_fft, self.hop, self.overlap = n_fft, hop, n_fft // hop
        self.pad = (n_fft - hop) // 2
        self.window = hann_window(n_fft, device)
        tail = n_fft - hop
        self.tail = torch.zeros(batch, tail, device=device)  # numerator of samples still open
        self.env_tail = torch.zeros(1, tail, device=device)  # window-square envelope of the same
        self.to_trim = self.pad  # leading samples still to drop
        self.frames = 0

    def _overlap_add(self, frames: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        b, t, _ = frames.shape
        acc = torch.cat([tail, tail.new_zeros(b, t * self.hop)], dim=1)
        blocks = acc.view(b, -1, self.hop)  # (B, t + overlap - 1, hop)
        parts = frames.reshape(b, t, self.overlap, self.hop)
        # earliest frame first in every sample, whatever the chunking
        for j in reversed(range(self.overlap)):
            blocks[:, j : j + t] += parts[:, :, j]
        return acc

    def push(self, frames: torch.Tensor) -> torch.Tensor:
        """frames (B, T, n_fft) windowed -> (B, n) finished samples (n may be 0)."""
        b, t, n = frames.shape
        if n != self.n_fft or b != self.tail.shape[0]:
            raise ValueError(f"expected frames (B={self.tail.shape[0]}, T, {self.n_fft}), got {tuple(frames.shape)}")
        if t == 0:
            return self.tail.new_zeros(b, 0)
        acc = self._overlap_add(frames.float(), self.tail)
        env = self._overlap_add(self.window.square().expand(1, t, -1), self.env_tail)
        done = t * self.hop
        self.tail, self.env_tail = acc[:, done:], env[:, done:]
        self.frames += t
        return self._emit(acc[:, :done], env[:, :done])

    def flush(self) -> torch.Tensor:
        """Samples after the last frame's hop, up to the end of the trimmed signal; ends the stream."""
        if self.frames == 0:
            return self.tail.new_zeros(self.tail.shape[0], 0)
        keep = self.n_fft - self.hop - self.pad
        out = self._emit(self.tail[:, :keep], self.env_tail[:, :keep])
        self.tail = torch.zeros_like(self.tail)  # new tensors: a clone() may share the old ones
        self.env_tail = torch.zeros_like(self.env_tail)
        return out

    @staticmethod
    def stack(states: list[StreamingISTFT]) -> StreamingISTFT:
        """One state whose row b is ``states[b]``; they must share envelope and trim (steady state)."""
        new = states[0].clone()
        new.tail = torch.cat([s.tail for s in states])
        return new

    def row(self, b: int) -> StreamingISTFT:
        new = self.clone()
        new.tail = self.tail[b : b + 1]
        return new

    def clone(self) -> StreamingISTFT:
        """An independent copy; cheap, because state tensors are replaced, never written in place."""
        return copy.copy(self)

    def _emit(self, num: torch.Tensor, env: torch.Tensor) -> torch.Tensor:
        if self.to_trim:
            cut = min(self.to_trim, num.shape[1])
            num, env = num[:, cut:], env[:, cut:]
            self.to_trim -= cut
        return num / env
