"""Bidirectional transformer pieces shared by the DiT flow head and the PatchEncoder.

Parameter names follow the reference so that the official safetensors load as they are.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.attention import get_backend
from engine.layers.rope import apply_interleaved


class Attention(nn.Module):
    """Multi-head self-attention, full (non-causal), interleaved RoPE on the whole head."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); cos/sin (1, 1, T, C/heads)."""
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        q, k = apply_interleaved(q, cos, sin), apply_interleaved(k, cos, sin)
        out = get_backend().attend(q, k, v, None)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear, stored as ``ff.0.0`` and ``ff.2``."""

    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),  # index 1 was dropout in training
            nn.Linear(inner, dim),
        )

    def forward(self, x):
        return self.ff(x)


class ConvBlock(nn.Module):
    """Conv1d(k3) -> Mish -> Conv1d(k3) over time, same length. x (B, T, C) -> (B, T, C)."""

    def __init__(self, dim: int, kernel_size: int = 3):
        super().__init__()
        pad = (kernel_size - 1) // 2
        self.block = nn.Sequential(
            nn.Conv1d(dim, dim, kernel_size, padding=pad), nn.Mish(), nn.Conv1d(dim, dim, kernel_size, padding=pad)
        )

    def forward(self, x):
        return self.block(x.transpose(1, 2)).transpose(1, 2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> sinusoid of 1000 t (256 dims, [sin, cos]) -> MLP to ``dim``."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t (B,) -> (B, dim)."""
        half = self.freq_dim // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        args = 1000 * t.float()[:, None] * freqs[None]
        emb = torch.cat([args.sin(), args.cos()], dim=-1).to(t.dtype)
        return self.time_mlp(emb)


def silu_linear(dim: int, out: int) -> nn.Sequential:
    """``adaLN_modulation``: SiLU then Linear (stored as index 1)."""
    return nn.Sequential(nn.SiLU(), nn.Linear(dim, out))
