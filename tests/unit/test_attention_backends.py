"""Attention paths of the backbone: FlashInfer's page metadata (checked with a pure-PyTorch double that
has FlashInfer 0.7.4's wrapper API), and the fallback to SDPA with its reason for every failure mode."""

from __future__ import annotations

import logging
import types
import typing

import pytest
import torch
import torch.nn.functional as F

from engine.generator import Generator
from engine.kv_cache import PagedCache
from engine.layers import attention
from engine.layers.flashinfer import page_metadata
from tests.generation import generate_together


def assert_agree(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Same lengths; the first patch within 1e-4, the whole stream at > 60 dB SNR. (Attention
    over a stream's own keys and over masked padding round differently in the last bit, and 8-layer
    random-weight generation amplifies that over the patches; wrong pages give ~0 dB.)"""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g[:1], w[:1], atol=1e-4, rtol=1e-4)
        snr = 10 * torch.log10(w.pow(2).sum() / (g - w).pow(2).sum().clamp_min(1e-30))
        assert snr > 60, f"SNR {float(snr):.1f} dB"


# --- a test double of flashinfer: same constructor/plan/run argument layout, NHD pages, pure PyTorch ----------
def _pages(cache, indices, indptr, last, b, page_size):
    pages = indices[indptr[b] : indptr[b + 1]].long()
    n = (len(pages) - 1) * page_size + int(last[b])
    return cache[pages].reshape(-1, *cache.shape[2:])[:n].transpose(0, 1)  # (Hkv, n, D)


def _check(ints, b):
    assert all(t.dtype == torch.int32 for t in ints), "FlashInfer takes int32 page metadata"
    assert ints[0].shape == (b + 1,) and ints[0][0] == 0


class FakeDecode:
    calls: typing.ClassVar[list] = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, q_data_type="float16", kv_data_type=None, **kw):  # fmt: skip
        _check([indptr, indices, last_page_len], len(last_page_len))
        assert pos_encoding_mode == "NONE" and window_left == -1 and not kw
        assert ((1 <= last_page_len) & (last_page_len <= page_size)).all()
        self.p = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type)
        FakeDecode.calls.append("plan")

    def run(self, q, paged_kv_cache):
        indptr, indices, last, hq, hk, d, ps, qdt = self.p
        kc, vc = paged_kv_cache
        assert kc.shape[1:] == (ps, hk, d) and q.shape[1:] == (hq, d) and q.dtype == qdt
        outs = []
        for b in range(q.shape[0]):
            k, v = _pages(kc, indices, indptr, last, b, ps), _pages(vc, indices, indptr, last, b, ps)
            outs.append(F.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)[:, 0])
        return torch.stack(outs)


class FakePrefill:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", *, q_data_type="float16", kv_data_type=None, **kw):  # fmt: skip
        _check([qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len], len(paged_kv_last_page_len))
        assert causal and custom_mask is None and not kw
        self.p = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                  head_dim_qk, page_size, q_data_type)  # fmt: skip

    def run(self, q, paged_kv_cache):
        qo, indptr, indices, last, hq, _, d, ps, qdt = self.p
        kc, vc = paged_kv_cache
        assert q.dtype == qdt and q.shape == (int(qo[-1]), hq, d)
        out = torch.empty_like(q)
        for b in range(len(last)):
            k, v = _pages(kc, indices, indptr, last, b, ps), _pages(vc, indices, indptr, last, b, ps)
            qb = q[qo[b] : qo[b + 1]].transpose(0, 1)  # (Hq, qn, D)
            qn, n = qb.shape[1], k.shape[1]
            ok = torch.arange(n)[None, :] <= torch.arange(qn)[:, None] + (n - qn)  # causal, aligned to the end
            out[qo[b] : qo[b + 1]] = F.scaled_dot_product_attention(qb, k, v, attn_mask=ok, enable_gqa=True).transpose(
                0, 1
            )
        return out


def fake_flashinfer(**broken):
    m = types.SimpleNamespace(__version__="0.7.4-double")
    m.BatchDecodeWithPagedKVCacheWrapper = broken.get("decode", FakeDecode)
    m.BatchPrefillWithPagedKVCacheWrapper = broken.get("prefill", FakePrefill)
    return m


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(attention, "_logged", set())


def _paged(model, n, module, page_size=16):
    choice = attention.AttentionChoice("flashinfer", "", module)
    cache = PagedCache(model.core.cfg.backbone, n, 128, "cpu", torch.float32, None, page_size, choice)
    return Generator(model.core, cache)


def _sdpa(model, n, page_size=16):
    return Generator(model.core, PagedCache(model.core.cfg.backbone, n, 128, "cpu", torch.float32, None, page_size))


# --- page metadata ------------------------------------------------------------------------------------
def test_page_metadata_layout():
    table = torch.tensor([[7, 3, 9, 0], [0, 0, 0, 0], [4, 0, 0, 0]])
    indptr, indices, last = page_metadata(table, [0, 2], [9, 4], 4)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [7, 3, 9, 4] and last.tolist() == [1, 4]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


def test_one_layer_through_the_double_equals_sdpa_on_gathered_pages(model):
    """Three rows of different lengths, one decode token each: the planned step's result is SDPA's."""
    cfg = model.core.cfg.backbone
    choice = attention.AttentionChoice("flashinfer", "", fake_flashinfer())
    fi = PagedCache(cfg, 3, 64, "cpu", torch.float32, None, 4, choice)
    sd = PagedCache(cfg, 3, 64, "cpu", torch.float32, None, 4)
    torch.manual_seed(0)
    lens = [5, 12, 1]
    for cache in (fi, sd):  # each row's 64 positions: pages 1-16, 17-32, 33-48
        cache.assign({s: [(i, 16 * s + i + 1) for i in range(16)] for s in range(len(lens))})
    for s, n in enumerate(lens):  # the same prompts in both
        k, v = torch.randn(2, 1, cfg.num_kv_heads, n, cfg.head_dim)
        for cache in (fi, sd):
            cache.batch([s], [0], n).update(0, k, v)
    q = torch.randn(3, cfg.num_heads, 1, cfg.head_dim)
    k, v = torch.randn(2, 3, cfg.num_kv_heads, 1, cfg.head_dim)
    outs = []
    for cache in (fi, sd):
        view = cache.batch([0, 1, 2], lens, 1)
        kk, vv = view.update(0, k, v)
        outs.append(attention.get_backend().attend(q, kk, vv, view.mask()))
    assert fi.attention == "flashinfer" and isinstance(fi.batch([0], [6], 1).mask(), attention.PlannedAttention)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 4])
def test_generation_through_the_double_equals_sdpa(model, n):
    """Prefill (prefill wrapper, causal) and decode (decode wrapper) through FlashInfer's API give SDPA's
    latents (not bit for bit: the double attends over each stream's own keys, SDPA over padded rows)."""
    FakeDecode.calls = []
    want = generate_together(_sdpa(model, n, page_size=4), model, n)
    gen = _paged(model, n, fake_flashinfer(), page_size=4)
    got = generate_together(gen, model, n)
    assert gen.attention == "flashinfer" and gen.attention_fallback_reason == ""
    steps = max(i + len(w) for i, w in enumerate(want))  # stream i joins at step i
    assert len(FakeDecode.calls) == steps - 1  # once per step that decodes (all but the first), not per layer
    assert_agree(got, want)


# --- fallback reasons -------------------------------------------------------------------------------------
def test_sdpa_when_asked():
    c = attention.select_attention("sdpa", "cuda", torch.bfloat16, 128)
    assert (c.name, c.reason) == ("sdpa", "")
    with pytest.raises(ValueError, match="attention must be one of"):
        attention.select_attention("xformers", "cpu", torch.float32, 128)


def test_no_cuda(caplog):
    with caplog.at_level(logging.INFO, logger=attention.log.name):
        for _ in range(3):
            c = attention.select_attention("auto", "cpu", torch.bfloat16, 128)
            assert (c.name, c.reason) == ("sdpa", "no_cuda")
    assert sum("reason no_cuda" in r.getMessage() for r in caplog.records) == 1  # logged once, by name


def test_package_missing(monkeypatch, caplog):
    def missing():
        raise ImportError("No module named 'flashinfer'")

    monkeypatch.setattr(attention, "_import_flashinfer", missing)
    with caplog.at_level(logging.WARNING, logger=attention.log.name):
        c = attention.select_attention("flashinfer", "cuda", torch.bfloat16, 128)
    assert (c.name, c.reason) == ("sdpa", "not_installed")
    assert "reason not_installed" in caplog.text and "No module named" in caplog.text


def test_head_size_and_dtype(monkeypatch):
    monkeypatch.setattr(attention, "_import_flashinfer", fake_flashinfer)
    assert attention.select_attention("auto", "cuda", torch.bfloat16, 16).reason == "head_dim"
    assert attention.select_attention("auto", "cuda", torch.float32, 128).reason == "dtype"
    c = attention.select_attention("auto", "cuda", torch.bfloat16, 128)
    assert (c.name, c.reason) == ("flashinfer", "") and c.module.__version__ == "0.7.4-double"


class _Raises(FakeDecode):
    def __init__(self, *a, where, **k):
        super().__init__(*a, **k)
        self.where = where

    def plan(self, *a, **k):
        if self.where == "plan":
            raise RuntimeError("no kernel for this configuration")
        super().plan(*a, **k)

    def run(self, q, kv):
        if self.where == "run":
            raise RuntimeError("CUDA error: an illegal memory access")
        return super().run(q, kv)


@pytest.mark.parametrize("where", ["plan", "run"])
def test_plan_or_run_failure_falls_back_and_generation_continues(model, where, caplog):
    class Decode(_Raises):
        def __init__(self, *a, **k):
            super().__init__(*a, where=where, **k)

    want = generate_together(_sdpa(model, 3), model, 3)
    gen = _paged(model, 3, fake_flashinfer(decode=Decode))
    with caplog.at_level(logging.WARNING, logger=attention.log.name):
        got = generate_together(gen, model, 3)
    reason = f"{where}_failed"
    assert gen.attention == "sdpa" and gen.attention_fallback_reason == reason
    assert sum(f"reason {reason}" in r.getMessage() for r in caplog.records) == 1
    assert_agree(got, want)  # the prefills ran on the double, the rest on SDPA


def test_wrapper_construction_failure_is_a_plan_failure(model):
    def broken(*a, **k):
        raise RuntimeError("workspace")

    gen = _paged(model, 1, fake_flashinfer(prefill=broken))
    assert (gen.attention, gen.attention_fallback_reason) == ("sdpa", "plan_failed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_flashinfer_matches_sdpa_on_gpu():
    """The installed FlashInfer, prefill and decode, on the backbone's head layout: SDPA's result."""
    pytest.importorskip("flashinfer")
    from engine.config import QWEN3_1_7B

    cfg = QWEN3_1_7B
    choice = attention.select_attention("flashinfer", "cuda", torch.bfloat16, cfg.head_dim)
    assert choice.name == "flashinfer", choice.reason
    fi = PagedCache(cfg, 4, 256, "cuda", torch.bfloat16, None, 16, choice)
    sd = PagedCache(cfg, 4, 256, "cuda", torch.bfloat16, None, 16)
    g = torch.Generator("cuda").manual_seed(0)
    lens = [1, 17, 100, 33]
    outs = {id(fi): [], id(sd): []}
    for s, n in enumerate(lens):
        q = torch.randn(1, cfg.num_heads, n, cfg.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = torch.randn(2, 1, cfg.num_kv_heads, n, cfg.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        for cache in (fi, sd):
            cache.assign({s: [(i, 16 * s + i + 1) for i in range(16)]})  # its 256 positions
            view = cache.batch([s], [0], n)
            outs[id(cache)].append(attention.get_backend().attend(q, *view.update(3, k, v), view.mask()))
    q = torch.randn(4, cfg.num_heads, 1, cfg.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = torch.randn(2, 4, cfg.num_kv_heads, 1, cfg.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    for cache in (fi, sd):
        view = cache.batch([0, 1, 2, 3], lens, 1)
        outs[id(cache)].append(attention.get_backend().attend(q, *view.update(3, k, v), view.mask()))
    assert fi.attention == "flashinfer", fi.attention_fallback_reason
    for a, b in zip(outs[id(fi)], outs[id(sd)], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
