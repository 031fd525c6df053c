"""Qwen3 decoder stack (the backbone and the RedAE transformers), parameter names as in Hugging Face.

The stack is agnostic of how keys are cached: ``forward`` takes an optional ``cache`` with
``update(layer, k, v) -> (k_all, v_all)`` and the attention mask to use with the keys it returns.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import Qwen3Config
from engine.layers.attention import get_backend, window_mask
from engine.layers.norm import RMSNorm
from engine.layers.rope import apply_halves, rope_halves


class LayerCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, Hkv, T, D) new keys/values of ``layer``; return all keys/values to attend to."""
        ...


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def forward(self, x, cos, sin, mask, layer: int, cache: LayerCache | None):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = apply_halves(q, cos, sin), apply_halves(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = get_backend().attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, cos, sin, mask, layer, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Stack(nn.Module):
    """``Qwen3Model`` without its token lookup in the forward pass (callers pass embeddings).

    ``embed_tokens`` exists only when ``with_embeddings`` (the backbone); RedAE stacks carry an unused
    one in the official files, which the loader skips.
    """

    def __init__(self, cfg: Qwen3Config, with_embeddings: bool = False):
        super().__init__()
        self.cfg = cfg
        if with_embeddings:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask=None,
    ) -> torch.Tensor:
        """Run all layers and the final norm.

        Args:
            x: (B, T, C) input embeddings.
            positions: (B, T) absolute positions; default 0..T-1.
            cache: where keys/values are kept between calls; None = this call sees only ``x``.
            mask: attention mask for the keys the cache returns; default causal (with the config's
                sliding window) over ``x`` alone.
        Returns:
            (B, T, C) normalised hidden states.
        """
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        if mask is None:
            if cache is not None:
                raise ValueError("a cached forward needs the cache's mask")
            win = self.cfg.sliding_window
            mask = "causal" if win is None or win >= t else window_mask(positions, positions, win)
        cos, sin = rope_halves(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, i, cache)
        return self.norm(x)
