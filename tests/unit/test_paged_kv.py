"""The paged backbone cache: pages, reservations, admission, and generation equal to the per-slot cache."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager, pages_for
from engine.chunking import ChunkSchedule
from engine.generator import Generator
from engine.kv_cache import PagedCache, bytes_per_position, pages_for_memory, typical_positions
from engine.params import GenerationParams
from engine.scheduler import Scheduler
from engine.streams import GeneratorService
from tests.generation import check_disjoint, generate_together, run_to_end
from tests.slot_cache import SlotCache

FOURS = ChunkSchedule(4, 4, fixed=True)  # chunk lists are compared between runs


def _cache(model, slots=2, max_len=64, num_pages=None, page_size=4):
    return PagedCache(model.core.cfg.backbone, slots, max_len, "cpu", torch.float32, num_pages, page_size)


def test_the_pages_each_plan_takes_are_written_into_the_table_and_a_forward_needs_them(model):
    cfg = model.core.cfg.backbone
    cache = _cache(model, slots=2, max_len=20, num_pages=6, page_size=4)
    blocks = BlockManager(2, 20, 6, 4)
    scheduler = Scheduler(2, blocks)
    assert scheduler.admit(4, 4, 1).slot == 0  # holds row 0 and one page's reservation, never stepped
    assert scheduler.admit(5, 9, 3).slot == 1  # 3 pages promised, none taken yet
    assert blocks.pages_in_use == 0 and blocks.pages_available == 2
    with pytest.raises(RuntimeError, match="its row of the page table has 0"):
        cache.batch([1], [0], 3)  # no plan gave it pages yet
    plan = scheduler.schedule([5])
    assert plan.pages == {1: [(0, 1)]}  # its prefix of 3 positions: one page, the first free one
    cache.assign(plan.pages)
    k = torch.randn(1, cfg.num_kv_heads, 3, cfg.head_dim)
    view = cache.batch([1], [0], 3)
    view.update(0, k, k + 1)
    assert len(blocks.pages[1]) == 1
    page = blocks.pages[1][0]
    assert torch.equal(cache.k[0, page, :3], k[0].transpose(0, 1))  # NHD: (page, offset, head, dim)
    assert torch.equal(cache.v[0, page, :3], (k + 1)[0].transpose(0, 1))
    for pos in range(3, 9):  # decode one key at a time: pages 2 and 3 come at positions 4 and 8
        plan = scheduler.schedule([5])
        assert plan.pages == ({1: [(pos // 4, pos // 4 + 1)]} if pos % 4 == 0 else {})
        cache.assign(plan.pages)
        one = torch.full((1, cfg.num_kv_heads, 1, cfg.head_dim), float(pos))
        view = cache.batch([1], [pos], 1)
        got_k, _ = view.update(0, one, one)
        assert len(blocks.pages[1]) == pos // 4 + 1
        assert got_k.shape == (1, cfg.num_kv_heads, pos + 1, cfg.head_dim)
        assert torch.equal(got_k[0, :, :3], k[0]) and torch.equal(got_k[0, :, pos], one[0, :, 0])
    assert cache.table[1, :3].tolist() == blocks.pages[1] and len(set(blocks.pages[1])) == 3
    with pytest.raises(RuntimeError, match="its row of the page table has 3"):
        cache.batch([1], [9], 4)  # 13 positions: past the 3 pages it was given
    check_disjoint(blocks, cache)
    for _ in range(3):  # positions 10..12 still fit its 3 pages
        assert scheduler.schedule([5]).pages == {}
    with pytest.raises(RuntimeError, match="exceed its reservation of 3 pages"):
        scheduler.schedule([5])  # 13 positions: past the 3 pages it reserved
    scheduler.finish(5)
    scheduler.finish(4)
    assert blocks.pages_in_use == 0 and blocks.committed == 0
    assert scheduler.admit(6, 2, 2).slot == 1  # the next stream in row 1: its own page, then zero pages
    cache.assign(scheduler.schedule([6]).pages)
    cache.batch([1], [0], 2)
    assert cache.table[1].tolist() == [blocks.pages[1][0], 0, 0, 0, 0]


def test_default_pool_matches_the_per_slot_cache_and_sizes_follow_the_tensors(model):
    cfg = model.core.cfg.backbone
    cache = PagedCache(cfg, 4, 100, "cpu", torch.float32)
    assert cache.num_pages == 4 * 7  # ceil(100 / 16) pages per slot
    slot = SlotCache(cfg, 4, 100, "cpu", torch.float32)
    assert cache.k.numel() - cache.k[:, 0].numel() >= slot.k.numel()  # the zero page aside
    # what the allocated tensors really take per position (the zero page included in both counts)
    held = (cache.k.numel() + cache.v.numel()) * cache.k.element_size()
    assert bytes_per_position(cfg, torch.float32) * (cache.num_pages + 1) * 16 == held
    pages = pages_for_memory(cfg, 0.001, torch.float32, 16)  # ~1 MiB: the most pages that fit, no more
    sized = PagedCache(cfg, 1, 16, "cpu", torch.float32, num_pages=pages)
    page_bytes = (sized.k[:, 0].numel() + sized.v[:, 0].numel()) * 4
    assert pages * page_bytes <= 0.001 * (1 << 30) < (pages + 1) * page_bytes
    prefix, speech = typical_positions()
    assert (prefix, speech) == (1 + 100 + 63, 94)  # 25 s of text at 4 tokens/s, 10 s + 15 s at 6.25 patches/s


@pytest.mark.parametrize("n", [1, 8])
def test_paged_generation_is_bit_identical_to_the_per_slot_cache(model, n):
    cfg = model.core.cfg.backbone
    want = generate_together(Generator(model.core, SlotCache(cfg, n, 128, "cpu", torch.float32)), model, n)
    paged = Generator(model.core, _cache(model, slots=n, max_len=128, page_size=16))
    got = generate_together(paged, model, n)
    assert [len(g) for g in got] == [5 + 7 * i for i in range(n)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_stream_the_pool_can_never_hold_is_refused_and_one_that_fits_later_waits(model):
    gen = Generator(model.core, _cache(model, slots=2, max_len=512, num_pages=3, page_size=16))
    blocks = BlockManager(2, 512, gen.cache.num_pages, gen.cache.page_size)
    scheduler = Scheduler(2, blocks)
    prompt = model.encode_prompt(None)
    toks = model.tokens("Hello", "English", prompt)
    big = gen.new_stream(0, toks, prompt, GenerationParams(max_patches=100))
    with pytest.raises(ValueError, match="KV-cache pages of 16 positions; the whole pool has 3"):
        scheduler.admit(7, big.positions_needed(), big.prefix_length())
    assert scheduler.active == 0 and blocks.committed == 0
    a = gen.new_stream(0, toks, prompt, GenerationParams(max_patches=20))
    assert pages_for(a.positions_needed(), 16) == 2  # two of the three pages: a second one must wait
    scheduler.admit(1, a.positions_needed(), a.prefix_length())
    scheduler.admit(2, a.positions_needed(), a.prefix_length())
    assert scheduler.schedule([1, 2]).waiting == [2]
    scheduler.finish(1)
    assert scheduler.schedule([2]).started == [2]


def _service(model, slots, kv_pages):
    svc = GeneratorService(model, slots=slots, max_len=512, kv_pages=kv_pages, attention="sdpa")
    assert svc.gen.cache.page_size == 16
    return svc


def test_service_frees_pages_on_end_cancel_and_error(model):
    prompt = model.encode_prompt(None)
    toks = model.tokens("Pages", "English", prompt)
    svc = _service(model, 3, None)
    cache, blocks = svc.gen.cache, svc.scheduler.blocks
    params = GenerationParams(seed=1, min_patches=20, max_patches=20)
    for i in (1, 2, 3):
        svc.admit(i, toks, prompt, params)
    for _ in range(3):
        svc.step([1, 2, 3])
    assert blocks.pages_in_use > 0 and len(svc.waiting) == 0
    check_disjoint(blocks, cache)
    slot2 = svc.live[2].state.slot
    svc.cancel(2)  # cancelled
    assert blocks.pages[slot2] == [] and blocks.reserved[slot2] == 0
    pages = blocks.pages
    assert pages[svc.live[1].state.slot] and pages[svc.live[3].state.slot]  # the others keep theirs
    assert sum(len(p) for p in blocks.pages) == blocks.pages_in_use

    def broken(*a, **k):
        raise RuntimeError("boom")

    svc.gen.core.flow, real = broken, svc.gen.core.flow  # an instance attribute shadows the method
    try:
        with pytest.raises(RuntimeError, match="boom"):
            svc.step([1, 3])
    finally:
        del svc.gen.core.flow
    assert svc.gen.core.flow == real
    svc.drop(3)  # what the generator model does with the streams of a failed step
    assert [len(p) for p in blocks.pages].count(0) == 2
    run_to_end(svc, 1)  # ends normally
    assert svc.active == 0 and blocks.pages_in_use == 0 and blocks.committed == 0
    check_disjoint(blocks, cache)


def _stream_inputs(model, text: str, patches: int):
    """A silent prompt, ``text``'s tokens, params of exactly ``patches`` patches, and the 16-position
    pages such a stream reserves."""
    prompt = model.encode_prompt(None)
    toks = model.tokens(text, "English", prompt)
    params = GenerationParams(seed=3, min_patches=patches, max_patches=patches)
    return prompt, toks, params, pages_for(1 + len(toks) + prompt.num_patches + patches, 16)


def test_service_makes_a_stream_wait_for_pages_then_runs_it_unchanged(model):
    prompt, toks, params, need = _stream_inputs(model, "Wait for me", 9)
    solo = _service(model, 1, None)
    solo.admit(5, toks, prompt, params, FOURS)
    want = run_to_end(solo, 5)

    svc = _service(model, 3, need + need // 2)  # room for one such stream at a time
    svc.admit(1, toks, prompt, params, FOURS)
    svc.admit(2, toks, prompt, params, FOURS)  # a slot is free, pages are not: it waits, not fails
    assert list(svc.waiting) == [2] and svc.active == 2
    first = []
    while not first or not first[-1].last:
        out = svc.step([1, 2])
        assert out[2] is None and svc.live[2].state.patches == 0  # not stepped while waiting
        if out[1] is not None:
            first.append(out[1])
    assert list(svc.waiting) == [2]  # still queued: stream 1 gave its pages back only at its end
    second = run_to_end(svc, 2)
    assert not svc.waiting and svc.active == 0
    for got in (first, second):
        assert [c.latents.tolist() for c in got] == [c.latents.tolist() for c in want]
    with pytest.raises(ValueError, match="the whole pool has"):  # never fits: refused, nothing kept
        svc.admit(3, toks, prompt, GenerationParams(max_patches=400))
    assert svc.active == 0 and len(svc.free) == 3


def test_a_cancelled_waiting_stream_leaves_the_queue(model):
    prompt, toks, params, need = _stream_inputs(model, "Queue", 30)
    svc = _service(model, 3, need)
    svc.admit(1, toks, prompt, params)
    svc.admit(2, toks, prompt, params)
    svc.admit(3, toks, prompt, params)
    assert list(svc.waiting) == [2, 3]
    svc.cancel(2)
    assert list(svc.waiting) == [3]
    svc.cancel(1)
    svc.step([3])
    assert not svc.waiting and svc.live[3].state.patches == 1
