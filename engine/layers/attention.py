"""Attention behind one small interface, so that a FlashInfer backend can replace SDPA on CUDA.

Every attention call in the engine goes through :func:`get_backend().attend`. Masks are built by the
caller (the KV cache knows lengths and windows); a backend may ignore the boolean mask when it is given
the same information in another form, but must produce the same result.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class AttentionBackend:
    """Scaled dot-product attention with grouped KV heads.

    ``attend(q, k, v, mask)``: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) with Hq a multiple of Hkv (query head
    h reads KV head h // (Hq / Hkv)); mask None (full attention), the string "causal" (Tq == Tk), or a
    bool tensor broadcastable to (B, 1, Tq, Tk), True = may attend. Returns (B, Hq, Tq, D).
    """

    name = "base"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        raise NotImplementedError


class SDPABackend(AttentionBackend):
    """PyTorch ``scaled_dot_product_attention`` (CPU and CUDA)."""

    name = "sdpa"

    def attend(self, q, k, v, mask):
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unknown mask kind {mask!r}")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


_BACKEND: AttentionBackend = SDPABackend()


def get_backend() -> AttentionBackend:
    return _BACKEND


def set_backend(backend: AttentionBackend) -> None:
    """Install an attention backend for the whole process (logged by name)."""
    global _BACKEND
    log.info("attention backend: %s", backend.name)
    _BACKEND = backend


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) mask from absolute positions.

    Args:
        q_pos: (B, Tq) query positions; k_pos: (B, Tk) key positions (-1 marks an empty key slot).
        window: keys visible to a query, itself included; None = unbounded.
    Returns:
        (B, 1, Tq, Tk) bool, True = may attend.
    """
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    ok = (diff >= 0) & (k_pos[:, None, :] >= 0)
    if window is not None:
        ok &= diff < window
    return ok[:, None]
