"""DiT flow head: predicts the velocity of the 4 noisy latents of a patch given clean history and
conditions. Blocks run attention -> conv -> FFN, each gated by AdaLN from the timestep embedding."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.blocks import Attention, ConvBlock, FeedForward, TimestepEmbedder, modulate, silu_linear
from engine.layers.norm import RMSNorm
from engine.layers.rope import rope_interleaved


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.conv = ConvBlock(dim)
        self.norm3 = RMSNorm(dim)
        self.mlp = FeedForward(dim, mlp_ratio)
        # chunk order in the checkpoint: (msa, mlp, conv) x (shift, scale, gate)
        self.adaLN_modulation = silu_linear(dim, 9 * dim)

    def forward(self, x, c, cos, sin):
        """x (B, T, C); c (B, 1, C) timestep condition."""
        sh_a, sc_a, g_a, sh_m, sc_m, g_m, sh_c, sc_c, g_c = self.adaLN_modulation(c).chunk(9, dim=-1)
        x = x + g_a * self.attn(modulate(self.norm1(x), sh_a, sc_a), cos, sin)
        x = x + g_c * self.conv(modulate(self.norm2(x), sh_c, sc_c))
        return x + g_m * self.mlp(modulate(self.norm3(x), sh_m, sc_m))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.adaLN_modulation = silu_linear(dim, 2 * dim)
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, hidden: int, depth: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(in_channels, hidden)
        self.t_embedder = TimestepEmbedder(hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, mlp_ratio) for _ in range(depth))
        self.final_layer = FinalLayer(hidden, out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x (B, T, in_channels) = [xt | backbone cond | speaker]; t (B,) in [0, 1] -> velocity (B, T, out)."""
        c = self.t_embedder(t)[:, None]
        x = self.in_proj(x)
        cos, sin = rope_interleaved(x.shape[1], x.shape[-1] // self.heads, 10_000.0, x.device)
        for block in self.blocks:
            x = block(x, c, cos, sin)
        return self.final_layer(x, c)
