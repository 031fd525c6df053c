"""Rotary position embeddings in the two layouts FireRedTTS3 uses.

- ``halves`` (Qwen3 stacks: backbone and RedAE): dimension i pairs with i + D/2.
- ``interleaved`` (DiT and PatchEncoder): dimension 2i pairs with 2i + 1.

Angles are computed in float32 and the rotation is done in the input's dtype, as the reference does.
"""

from __future__ import annotations

import torch


def inv_freq(dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """(D/2,) inverse frequencies ``base ** (-2i / D)``."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rope_halves(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the ``halves`` layout.

    Args:
        positions: (B, T) integer positions.
    Returns:
        cos, sin: (B, 1, T, D) float32, broadcastable over heads.
    """
    freqs = positions.float()[..., None] * inv_freq(dim, base, positions.device)  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by tables from :func:`rope_halves`."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rope_interleaved(seq_len: int, dim: int, base: float, device: torch.device | None = None):
    """cos/sin tables (1, 1, T, D) float32 for the ``interleaved`` layout, positions 0..T-1."""
    t = torch.arange(seq_len, device=device).float()
    freqs = t[:, None] * inv_freq(dim, base, device)  # (T, D/2)
    freqs = torch.stack([freqs, freqs], dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
    return freqs.cos()[None, None], freqs.sin()[None, None]


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by tables from :func:`rope_interleaved` (computed in float32)."""
    dtype = x.dtype
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(dtype)
