"""Key/value caches for the Qwen3 stacks.

- :class:`WindowCache`: one or more streams through a sliding-window stack (the RedAE decoder). Keeps
  only the last ``window - 1`` keys per layer, with their absolute positions (-1 = empty).
- :class:`PagedCache`: the backbone's cache as a pool of pages with a page table per stream (what the
  server uses): memory follows the streams' real lengths; a step hands the stack a view over the pages
  of the streams it runs (:class:`PagedBatch` for SDPA, a planned FlashInfer step on CUDA).
- Page bookkeeping (reservations, which pages a slot holds) is :mod:`engine.block_manager`, without torch,
  owned by the scheduler; the cache only writes the pages each step's plan took into its page table.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from engine.block_manager import PAGE_SIZE, pages_for, pool_pages
from engine.config import Qwen3Config
from engine.layers.attention import PlannedAttention, window_mask


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


# ---------------------------------------------------------------------------------------------------
# Paged backbone cache
# ---------------------------------------------------------------------------------------------------


def bytes_per_position(cfg: Qwen3Config, dtype: torch.dtype) -> int:
    """Keys and values of one position over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def pages_for_memory(cfg: Qwen3Config, gigabytes: float, dtype: torch.dtype, page_size: int = PAGE_SIZE) -> int:
    """How many pages ``gigabytes`` (GiB) of KV cache hold."""
    return int(gigabytes * (1 << 30) // (bytes_per_position(cfg, dtype) * page_size))


# A typical stream, for sizing: ``TYPICAL_SPEECH_S`` of speech after a ``TYPICAL_REFERENCE_S`` reference
# clip, whose transcript is part of the prompt. Backbone positions = 1 (speaker) + text tokens (both
# transcripts, ~``TEXT_TOKENS_PER_S`` per second of speech) + one per 160 ms patch of reference and speech.
TYPICAL_SPEECH_S, TYPICAL_REFERENCE_S, TEXT_TOKENS_PER_S = 15.0, 10.0, 4.0


def typical_positions(speech_s: float = TYPICAL_SPEECH_S, reference_s: float = TYPICAL_REFERENCE_S) -> tuple[int, int]:
    """(prefix, generated) backbone positions of a typical stream: ``prefix`` = speaker + text tokens +
    reference patches (the prompt), ``generated`` = speech patches."""
    from engine.config import PATCH_SAMPLES
    from engine.protocol import SAMPLE_RATE

    patches_per_s = SAMPLE_RATE / PATCH_SAMPLES  # 6.25
    prefix = 1 + math.ceil(TEXT_TOKENS_PER_S * (speech_s + reference_s)) + math.ceil(patches_per_s * reference_s)
    return prefix, math.ceil(patches_per_s * speech_s)


def capacity_line(
    cfg: Qwen3Config, dtype: torch.dtype, num_pages: int, slots: int, max_patches: int, page_size: int = PAGE_SIZE
) -> str:
    """One log line: a pool's size and how many typical streams it holds (by reservation and by use).
    Pure arithmetic: sizing a pool needs no pool."""
    prefix, speech = typical_positions()
    gib = num_pages * page_size * bytes_per_position(cfg, dtype) / (1 << 30)
    real = num_pages // pages_for(prefix + speech, page_size)
    held = num_pages // pages_for(prefix + max_patches, page_size)
    return (
        f"KV cache: {num_pages} pages of {page_size} positions ({gib:.2f} GiB, {dtype}), "
        f"{slots} streams at most; typical streams ({TYPICAL_SPEECH_S:g} s of speech after a "
        f"{TYPICAL_REFERENCE_S:g} s reference, {prefix} + {speech} positions): {min(held, slots)} admitted "
        f"at once when each reserves max_patches={max_patches} ({prefix + max_patches} positions), {real} by "
        "the pages they really fill"
    )


class PagedCache:
    """The backbone's cache as a pool of fixed-size pages with a page table per slot.

    Layout (FlashInfer's "NHD"): ``k``/``v`` of shape (layers, pages + 1, page_size, Hkv, head_dim).
    Page 0 is a zero page that is never handed out (it backs the padding a batch gathers).

    Which slot holds which pages, and which pages each slot was promised, is the scheduler's
    (:class:`~engine.scheduler.Scheduler` and its :class:`~engine.block_manager.BlockManager`, plain
    ints): it *reserves* the pages a stream may ever need (prompt + ``max_patches``), takes them as the
    stream grows, one step's worth in each plan, and gives them all back when it ends. The cache writes
    each plan's new pages into its page table (:meth:`assign`) and refuses a forward over positions
    whose pages it was not given (:meth:`batch`). The memory used follows the real lengths.

    ``slots`` is the number of page-table rows (streams at once); ``max_len`` the longest stream. The
    default pool (``num_pages`` None) holds ``slots`` streams of ``max_len`` positions.
    """

    def __init__(
        self, cfg: Qwen3Config, slots: int, max_len: int, device, dtype, num_pages: int | None = None,
        page_size: int = PAGE_SIZE, attention=None,
    ):  # fmt: skip
        self.cfg = cfg
        self.num_pages = pool_pages(slots, max_len, num_pages, page_size)
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        shape = (cfg.num_layers, self.num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # on the host: each slot's pages in position order, 0 (the zero page) past them
        self.table = torch.zeros(slots, pages_for(max_len, page_size), dtype=torch.long)
        self.held = [0] * slots  # pages in each slot's row of the table
        self.attention = "sdpa"
        self.attention_fallback_reason = ""
        self._flashinfer = None
        if attention is not None:
            self.use_attention(attention)

    # -- attention path -------------------------------------------------------------------------------
    def use_attention(self, choice) -> None:
        """Install an :class:`~engine.layers.attention.AttentionChoice` (see ``select_attention``)."""
        self.attention, self.attention_fallback_reason = choice.name, choice.reason
        self._flashinfer = None
        if choice.name == "flashinfer":
            from engine.layers.flashinfer import FlashInferPaged

            try:
                self._flashinfer = FlashInferPaged(choice.module, self.k.device, self.cfg, self.page_size)
            except Exception as e:  # wrapper construction is part of planning
                self.fall_back("plan_failed", e)

    def fall_back(self, reason: str, error: BaseException | None = None) -> None:
        """Leave FlashInfer for SDPA for good (logged once per reason)."""
        from engine.layers.attention import note_fallback

        note_fallback(reason, error)
        self.attention, self.attention_fallback_reason, self._flashinfer = "sdpa", reason, None

    # -- pages (the scheduler's; the page table here) ----------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.k.device

    def assign(self, pages: dict[int, list[tuple[int, int]]]) -> None:
        """Write a step plan's new pages (:attr:`engine.scheduler.StepPlan.pages`: slot -> (page-table
        index, page) pairs) into the page table. Index 0 starts a new stream in its row: nothing of the
        last one's pages is left."""
        for s, new in pages.items():
            for index, page in new:
                if index == 0:
                    self.table[s].zero_()
                elif index != self.held[s]:
                    raise ValueError(f"slot {s}: page index {index} given after {self.held[s]} pages")
                self.table[s, index] = page
                self.held[s] = index + 1

    def batch(self, slots: list[int], starts: list[int], length: int, rowwise: bool = False):
        """A view for one forward: row b writes ``length`` keys of slot ``slots[b]`` from ``starts[b]``.

        The pages for those keys must be in the page table already (:meth:`assign`); builds the step's
        page metadata once for all layers. ``rowwise``: each row attends over its own keys alone
        (batch-invariant: :mod:`engine.invariant`; the generator leaves FlashInfer then).
        """
        for s, p in zip(slots, starts):
            if not 0 <= s < self.slots:
                raise IndexError(f"slot {s} out of range 0..{self.slots - 1}")
            if p + length > self.max_len:
                raise ValueError(f"slot {s}: {p + length} positions exceed the cache length {self.max_len}")
            if pages_for(p + length, self.page_size) > self.held[s]:
                raise RuntimeError(
                    f"slot {s}: positions up to {p + length} need {pages_for(p + length, self.page_size)} pages; "
                    f"its row of the page table has {self.held[s]} (the step's plan assigns them)"
                )
        if self._flashinfer is not None:
            try:
                return self._flashinfer.batch(self, slots, starts, length)
            except Exception as e:
                self.fall_back("plan_failed", e)
        return PagedBatch(self, slots, starts, length, rowwise)


class PagedBatch:
    """Rows of a :class:`PagedCache` for one forward, attended with SDPA.

    Keys are gathered from each row's own pages into a (B, Hkv, kv_len, D) tensor, kv_len being the
    longest row: exactly the keys (and masked padding) a per-slot cache of ``max_len`` rows gives SDPA, so results are
    the same bits. Padding beyond a row's pages reads the zero page. One index tensor per forward
    serves every layer.
    """

    def __init__(self, cache: PagedCache, slots: list[int], starts: list[int], length: int, rowwise: bool = False):
        self.cache, self.rowwise, self.ends = cache, rowwise, [p + length for p in starts]
        dev = cache.k.device
        p = cache.page_size
        self.n = len(slots)
        self.starts = torch.tensor(starts, dtype=torch.long).to(dev, non_blocking=True)
        self.from_zero = len(slots) == 1 and starts[0] == 0  # from the host list: no device sync in mask()
        self.length = length
        self.positions = self.starts[:, None] + torch.arange(length, device=dev)  # (B, T)
        self.kv_len = max(starts) + length
        pos = torch.arange(self.kv_len)
        rows = cache.table[slots][:, pos // p]  # (B, kv_len) page of each position, on the host
        self.gather = (rows * p + pos % p).to(dev, non_blocking=True)  # flat index into a layer's pool
        self.write = torch.gather(self.gather, 1, self.positions)  # (B, T) where the new keys go

    def mask(self):
        """Causal mask over each row's own keys; "causal" for a single row starting at 0; a
        :class:`RowAttention` when ``rowwise``."""
        if self.rowwise:
            return RowAttention(self)
        if self.from_zero:
            return "causal"
        k_pos = torch.arange(self.kv_len, device=self.positions.device).expand(self.n, -1)
        return window_mask(self.positions, k_pos, None)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        ck = c.k[layer].view(-1, c.cfg.num_kv_heads, c.cfg.head_dim)  # (pages * page_size, Hkv, D)
        cv = c.v[layer].view(-1, c.cfg.num_kv_heads, c.cfg.head_dim)
        ck[self.write] = k.transpose(1, 2).to(ck.dtype)  # (B, T, Hkv, D)
        cv[self.write] = v.transpose(1, 2).to(cv.dtype)
        return ck[self.gather].transpose(1, 2), cv[self.gather].transpose(1, 2)


class RowAttention(PlannedAttention):
    """A :class:`PagedBatch`'s rows attended one at a time, each over exactly its own keys: what a row
    computes then does not depend on the batch's size or longest row (batch-invariant mode)."""

    def __init__(self, batch: PagedBatch):
        self.batch = batch

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, gqa, t = self.batch, q.shape[1] != k.shape[1], q.shape[2]
        out = []
        for row, end in enumerate(b.ends):
            qr, kr, vr = (x[row : row + 1].contiguous() for x in (q, k[:, :, :end], v[:, :, :end]))
            if t == 1:  # one new query: every key of the row is visible
                out.append(F.scaled_dot_product_attention(qr, kr, vr, enable_gqa=gqa))
            else:
                mask = window_mask(b.positions[row : row + 1], torch.arange(end, device=q.device)[None], None)
                out.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, enable_gqa=gqa))
        return torch.cat(out)
