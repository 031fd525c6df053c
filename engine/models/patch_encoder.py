"""PatchEncoder: folds one patch (4 latents) into the next backbone input embedding.

Each patch is encoded on its own: a CLS token goes first, 5 tokens attend bidirectionally, and the CLS
output is projected to the backbone width.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.blocks import Attention, FeedForward
from engine.layers.norm import RMSNorm
from engine.layers.rope import rope_interleaved


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.mlp = FeedForward(dim, mlp_ratio)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class OutProj(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm_final = RMSNorm(dim)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x):
        return self.linear(self.norm_final(x))


class PatchEncoder(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, patch_size: int, hidden: int, depth: int, heads: int, mlp_ratio):
        super().__init__()
        self.patch_size = patch_size
        self.hidden = hidden
        self.heads = heads
        self.cls_tok = nn.Parameter(torch.zeros(1, 1, hidden))
        self.blocks = nn.ModuleList(EncoderBlock(hidden, heads, mlp_ratio) for _ in range(depth))
        self.in_proj = nn.Linear(in_dim, hidden) if in_dim != hidden else nn.Identity()
        self.out_proj = OutProj(hidden, out_dim)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """latents (B, P * patch_size, in_dim) -> (B, P, out_dim), one embedding per patch."""
        b, t, _ = latents.shape
        if t % self.patch_size:
            raise ValueError(f"latent length {t} is not a multiple of the patch size {self.patch_size}")
        x = self.in_proj(latents).reshape(-1, self.patch_size, self.hidden)
        x = torch.cat([self.cls_tok.expand(x.shape[0], -1, -1), x], dim=1)
        cos, sin = rope_interleaved(x.shape[1], self.hidden // self.heads, 10_000.0, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.out_proj(x)[:, 0].reshape(b, t // self.patch_size, -1)
