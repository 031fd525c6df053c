"""Key/value caches for the Qwen3 stacks.

- :class:`WindowCache`: one or more streams through a sliding-window stack (the RedAE decoder). Keeps
  only the last ``window - 1`` keys per layer, with their absolute positions (-1 = empty).
- :class:`SlotCache`: the backbone's preallocated cache, one row per slot, written in place; a step
  hands the stack a :class:`SlotBatch` view over the slots it runs.
"""

from __future__ import annotations

import copy

import torch

from engine.config import Qwen3Config
from engine.layers.attention import window_mask


class WindowCache:
    """Sliding-window cache for B streams that advance together.

    Call :meth:`begin` with the new queries' positions, run the stack with ``cache=self, mask=...``,
    then :meth:`commit` to drop keys that no future query can see.
    """

    def __init__(self, num_layers: int, window: int):
        self.window = window
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos: torch.Tensor | None = None  # (B, L) positions of cached keys
        self._new_pos: torch.Tensor | None = None

    def clone(self) -> WindowCache:
        """An independent copy sharing tensors (they are replaced on update, never written in place)."""
        new = copy.copy(self)
        new.k, new.v = list(self.k), list(self.v)
        return new

    @staticmethod
    def stack(caches: list[WindowCache]) -> WindowCache:
        """One cache whose row b is ``caches[b]`` (single-row caches with as many cached keys)."""
        new = copy.copy(caches[0])
        new.k = [torch.cat(ks) for ks in zip(*(c.k for c in caches), strict=True)]
        new.v = [torch.cat(vs) for vs in zip(*(c.v for c in caches), strict=True)]
        new.pos = torch.cat([c.pos for c in caches])
        return new

    def row(self, b: int) -> WindowCache:
        """Row ``b`` as a single-row cache."""
        new = copy.copy(self)
        new.k, new.v = [k[b : b + 1] for k in self.k], [v[b : b + 1] for v in self.v]
        new.pos = self.pos[b : b + 1]
        return new

    def begin(self, q_pos: torch.Tensor) -> torch.Tensor:
        """Register (B, T) query positions; return the (B, 1, T, L+T) mask for this forward."""
        self._new_pos = q_pos
        k_pos = q_pos if self.pos is None else torch.cat([self.pos, q_pos], dim=1)
        return window_mask(q_pos, k_pos, self.window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def commit(self) -> None:
        keep = self.window - 1
        pos = self._new_pos if self.pos is None else torch.cat([self.pos, self._new_pos], dim=1)
        self.pos = pos[:, -keep:] if keep > 0 else pos[:, :0]
        for i in range(len(self.k)):
            self.k[i] = self.k[i][:, :, -keep:] if keep > 0 else self.k[i][:, :, :0]
            self.v[i] = self.v[i][:, :, -keep:] if keep > 0 else self.v[i][:, :, :0]
        self._new_pos = None


class SlotCache:
    """Preallocated backbone cache: k/v of shape (layers, slots, Hkv, max_len, head_dim)."""

    def __init__(self, cfg: Qwen3Config, slots: int, max_len: int, device, dtype):
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = slots
        self.max_len = max_len

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
        self.length = length
        self.positions = self.starts[:, None] + torch.arange(length, device=dev)  # (B, T)
        self.kv_len = max(starts) + length

    def mask(self):
        """Causal mask over each row's own keys; None-like "causal" when one row starts at 0."""
        if len(self.idx) == 1 and int(self.starts[0]) == 0:
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
