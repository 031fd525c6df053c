"""Attention behind one small interface, so that FlashInfer can replace SDPA for the backbone on CUDA.

Every attention call in the engine goes through :func:`get_backend().attend`. Masks are built by the
caller (the KV cache knows lengths and windows). The paged backbone cache may hand over, instead of a
mask, a :class:`PlannedAttention`: a step already planned for a paged kernel (FlashInfer), which then
runs on the cache's pages itself.

:func:`select_attention` picks the backbone's path for ``--attention {auto,sdpa,flashinfer}`` and says
why FlashInfer is not used (:data:`FALLBACK_REASONS`, logged once each).
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


class PlannedAttention:
    """A paged attention step planned once per forward (all layers reuse it); passed where a mask goes.

    ``run(q, k_pages, v_pages)``: q (B, Hq, T, D), the layer's pages as the cache's ``update`` returned
    them; returns (B, Hq, T, D).
    """

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SDPABackend(AttentionBackend):
    """PyTorch ``scaled_dot_product_attention`` (CPU and CUDA)."""

    name = "sdpa"

    def attend(self, q, k, v, mask):
        if isinstance(mask, PlannedAttention):
            return mask.run(q, k, v)
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unknown mask kind {mask!r}")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


_SDPA = SDPABackend()


def get_backend() -> AttentionBackend:
    """The backend every attention call goes through: SDPA, which hands a :class:`PlannedAttention`
    (a FlashInfer step the paged cache planned) to that plan."""
    return _SDPA


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


# ---------------------------------------------------------------------------------------------------
# Choosing the backbone's attention path
# ---------------------------------------------------------------------------------------------------

ATTENTION_CHOICES = ("auto", "sdpa", "flashinfer")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# Why FlashInfer is not used (a metric label value); "" when it is, or when SDPA was asked for.
FALLBACK_REASONS = {
    "no_cuda": "the model runs on CPU (FlashInfer needs CUDA)",
    "not_installed": "the flashinfer package cannot be imported (pip install flashinfer-python)",
    "head_dim": "FlashInfer has no kernel for this head size",
    "dtype": "FlashInfer needs float16 or bfloat16 (the backbone runs in another dtype)",
    "plan_failed": "planning a FlashInfer step raised",
    "run_failed": "running a FlashInfer step raised",
    "batch_invariant": "batch-invariant mode attends row by row on SDPA (--no-batch-invariant uses FlashInfer)",
}
_logged: set[str] = set()


class AttentionFallback(RuntimeError):
    """Raised by a planned step that could not run; the caller falls back to SDPA and runs it again."""

    def __init__(self, reason: str, error: BaseException | None = None):
        super().__init__(f"{reason}: {error}" if error is not None else reason)
        self.reason, self.error = reason, error


def note_fallback(reason: str, error: BaseException | None = None, level: int = logging.WARNING) -> None:
    """Log, once per process and reason, that the backbone attends with SDPA instead of FlashInfer."""
    if reason not in FALLBACK_REASONS:
        raise ValueError(f"unknown fallback reason {reason!r}")
    if reason in _logged:
        return
    _logged.add(reason)
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    log.log(level, "attention: FlashInfer not used, reason %s: %s%s; using SDPA", reason, FALLBACK_REASONS[reason],
            detail)  # fmt: skip


class AttentionChoice:
    """The backbone's attention path: ``name`` ("sdpa" or "flashinfer"), ``reason`` FlashInfer is not
    used ("" if it is or was not asked for), and the imported ``module`` for FlashInfer."""

    def __init__(self, name: str, reason: str = "", module=None):
        self.name, self.reason, self.module = name, reason, module

    def __repr__(self) -> str:
        return f"AttentionChoice({self.name!r}, reason={self.reason!r})"


def _import_flashinfer():
    import flashinfer

    return flashinfer


def select_attention(requested: str, device, dtype: torch.dtype, head_dim: int) -> AttentionChoice:
    """``auto``: FlashInfer when usable, else SDPA; ``flashinfer``: the same, but a fallback is a warning
    the operator asked to see; ``sdpa``: SDPA. Every reason FlashInfer is not used is logged once."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {requested!r}")
    if requested == "sdpa":
        return AttentionChoice("sdpa")
    reason, module, error = "", None, None
    if torch.device(device).type != "cuda":
        reason = "no_cuda"
    else:
        try:
            module = _import_flashinfer()
        except Exception as e:  # ImportError, or a broken install failing at import
            reason, error = "not_installed", e
    if not reason and head_dim not in FLASHINFER_HEAD_DIMS:
        reason = "head_dim"
    if not reason and dtype not in FLASHINFER_DTYPES:
        reason = "dtype"
    if reason:
        # auto on a machine without CUDA or without the package is the expected case: a line, not a warning
        quiet = requested == "auto" and reason in ("no_cuda", "not_installed")
        note_fallback(reason, error, logging.INFO if quiet else logging.WARNING)
        return AttentionChoice("sdpa", reason)
    log.info("attention: FlashInfer %s", getattr(module, "__version__", "?"))
    return AttentionChoice("flashinfer", "", module)
