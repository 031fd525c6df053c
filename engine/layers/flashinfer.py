"""The backbone's paged attention through FlashInfer (CUDA; an optional extra: ``pip install flashinfer-python``).

Written against flashinfer-python 0.7.4: ``BatchDecodeWithPagedKVCacheWrapper`` for decode steps (one
new token per stream) and ``BatchPrefillWithPagedKVCacheWrapper`` (``causal=True``) for a new stream's
prompt; both read the :class:`~engine.kv_cache.PagedCache` pages in place ("NHD": each layer's keys are
(pages, page_size, Hkv, D)), so nothing is gathered or copied. A step is planned once, before the first
layer, and every layer runs the same plan.

Page metadata per step (B streams, stream b holding ``n_b`` keys after this step's are written)::

    indptr        (B + 1,) int32   cumulative page counts: indices[indptr[b]:indptr[b+1]] are b's pages
    indices       (sum,)   int32   page ids in position order
    last_page_len (B,)     int32   keys in b's last page, 1..page_size
    qo_indptr     (B + 1,) int32   prefill only: cumulative query counts

Failures never stop generation: a plan that raises makes the cache fall back to SDPA before the
forward ("plan_failed"); a run that raises surfaces as
:class:`~engine.layers.attention.AttentionFallback` ("run_failed") and the generator repeats the
forward on SDPA (rewriting the same keys is harmless).
"""

from __future__ import annotations

import torch

from engine.layers.attention import AttentionFallback, PlannedAttention

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def page_metadata(table: torch.Tensor, slots: list[int], lengths: list[int], page_size: int):
    """(indptr, indices, last_page_len) on the host, int32, for rows holding ``lengths`` keys."""
    counts = [-(-n // page_size) for n in lengths]
    indptr = torch.zeros(len(slots) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts), 0)
    indices = torch.cat([table[s, :c] for s, c in zip(slots, counts)]).to(torch.int32)
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(lengths, counts)], dtype=torch.int32)
    return indptr, indices, last


class FlashInferPaged:
    """FlashInfer's two paged wrappers for one cache (they share the workspace: steps never overlap)."""

    def __init__(self, module, device, cfg, page_size: int):
        self.cfg, self.page_size, self.device = cfg, page_size, torch.device(device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.prefill = module.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def batch(self, cache, slots: list[int], starts: list[int], length: int) -> FlashInferBatch:
        lengths = [p + length for p in starts]
        indptr, indices, last = page_metadata(cache.table, slots, lengths, self.page_size)
        dev, cfg, dt = self.device, self.cfg, cache.k.dtype
        indptr, indices, last = (t.to(dev, non_blocking=True) for t in (indptr, indices, last))
        if length == 1:
            self.decode.plan(
                indptr, indices, last, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.page_size,
                pos_encoding_mode="NONE", q_data_type=dt, kv_data_type=dt,
            )  # fmt: skip
            wrapper = self.decode
        else:
            qo_indptr = torch.arange(len(slots) + 1, dtype=torch.int32, device=dev) * length
            self.prefill.plan(
                qo_indptr, indptr, indices, last, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.page_size,
                causal=True, pos_encoding_mode="NONE", q_data_type=dt, kv_data_type=dt,
            )  # fmt: skip
            wrapper = self.prefill
        return FlashInferBatch(cache, slots, starts, length, FlashInferStep(wrapper))


class FlashInferStep(PlannedAttention):
    def __init__(self, wrapper):
        self.wrapper = wrapper

    def run(self, q, k, v):
        b, hq, t, d = q.shape
        try:
            out = self.wrapper.run(q.transpose(1, 2).reshape(b * t, hq, d).to(k.dtype).contiguous(), (k, v))
        except Exception as e:
            raise AttentionFallback("run_failed", e) from e
        return out.view(b, t, hq, d).transpose(1, 2).to(q.dtype)


class FlashInferBatch:
    """Rows of a :class:`~engine.kv_cache.PagedCache` for one forward: writes the new keys into their
    pages and hands the layer's whole pool to the planned step (which reads only the rows' pages)."""

    def __init__(self, cache, slots: list[int], starts: list[int], length: int, step: FlashInferStep):
        self.cache, self.step = cache, step
        dev, p = cache.k.device, cache.page_size
        st = torch.tensor(starts, dtype=torch.long)
        pos = st[:, None] + torch.arange(length)  # (B, T) on the host
        self.positions = pos.to(dev, non_blocking=True)
        pages = torch.gather(cache.table[slots], 1, pos // p)
        self.write = (pages * p + pos % p).to(dev, non_blocking=True)  # (B, T) flat index into a layer's pool

    def mask(self) -> FlashInferStep:
        return self.step

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        hk, d = c.cfg.num_kv_heads, c.cfg.head_dim
        c.k[layer].view(-1, hk, d)[self.write] = k.transpose(1, 2).to(c.k.dtype)
        c.v[layer].view(-1, hk, d)[self.write] = v.transpose(1, 2).to(c.v.dtype)
        return c.k[layer], c.v[layer]
