"""A preallocated backbone cache, one ``max_len`` row per slot written in place: the simplest cache the
:class:`~engine.generator.Generator` can run on, kept here as the independent reference that the paged
cache (:class:`~engine.kv_cache.PagedCache`) is checked against (same keys, same bits)."""

from __future__ import annotations

import torch

from engine.config import Qwen3Config
from engine.layers.attention import window_mask


class SlotCache:
    """Preallocated backbone cache: k/v of shape (layers, slots, Hkv, max_len, head_dim)."""

    def __init__(self, cfg: Qwen3Config, slots: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = slots
        self.max_len = max_len

    # The generator's cache interface, shared with :class:`PagedCache` (a slot row holds max_len already).
    attention = "sdpa"
    attention_fallback_reason = ""

    @property
    def device(self) -> torch.device:
        return self.k.device

    def fall_back(self, reason: str, error: BaseException | None = None) -> None:
        raise RuntimeError("the per-slot cache has no other attention path to fall back to") from error

    def batch(self, slots: list[int], starts: list[int], length: int) -> SlotBatch:
        """A view for one forward: row b writes ``length`` keys of slot ``slots[b]`` from ``starts[b]``."""
        for s, p in zip(slots, starts):
            if not 0 <= s < self.slots:
                raise IndexError(f"slot {s} out of range 0..{self.slots - 1}")
            if p + length > self.max_len:
                raise ValueError(f"slot {s}: {p + length} positions exceed the cache length {self.max_len}")
        return SlotBatch(self, slots, starts, length)


class SlotBatch:
    """Rows of a :class:`SlotCache` for one forward (prefill of one slot, or one decode token per slot)."""

    def __init__(self, cache: SlotCache, slots: list[int], starts: list[int], length: int):
        self.cache = cache
        dev = cache.k.device
        self.idx = torch.tensor(slots, device=dev, dtype=torch.long)
        self.starts = torch.tensor(starts, device=dev, dtype=torch.long)
        self.from_zero = len(slots) == 1 and starts[0] == 0  # from the host list: no device sync in mask()
        self.length = length
        self.positions = self.starts[:, None] + torch.arange(length, device=dev)  # (B, T)
        self.kv_len = max(starts) + length

    def mask(self):
        """Causal mask over each row's own keys; None-like "causal" when one row starts at 0."""
        if self.from_zero:
            return "causal"
        k_pos = torch.arange(self.kv_len, device=self.idx.device).expand(len(self.idx), -1)
        return window_mask(self.positions, k_pos, None)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        rows = self.idx[:, None].expand_as(self.positions)
        # (B, H, T, D) -> index (slot, :, pos) needs (B, T, H, D)
        ck[rows, :, self.positions] = k.transpose(1, 2).to(ck.dtype)
        cv[rows, :, self.positions] = v.transpose(1, 2).to(cv.dtype)
        if len(self.idx) == 1:
            s = int(self.idx[0])
            return ck[s : s + 1, :, : self.kv_len], cv[s : s + 1, :, : self.kv_len]
        return ck[self.idx, :, : self.kv_len], cv[self.idx, :, : self.kv_len]
