"""Streams of different lengths joining a generator one per step and stepped together: the workload the
paged-cache and attention-backend tests compare two generators on; and a service's stream run to its end."""

from __future__ import annotations

import torch

from engine.generator import Generator
from engine.kv_cache import PagedCache
from engine.params import GenerationParams

TEXTS = ["One", "Two words here", "Three little words and more", "Four", "five six seven eight", "x",
         "a longer text with many tokens in it", "b"]  # fmt: skip


def check_disjoint(cache: PagedCache) -> None:
    """No page held twice, the zero page never handed out, none lost."""
    blocks = cache.blocks
    owned = [p for p in blocks.pages if p]
    flat = [page for p in owned for page in p]
    assert len(flat) == len(set(flat)), "a page is held by two streams"
    assert 0 not in flat, "the zero page was handed out"
    assert len(flat) + len(blocks.free_pages) == blocks.num_pages, "a page was lost or duplicated"
    assert len(set(blocks.free_pages)) == len(blocks.free_pages)


def generate_together(gen: Generator, model, n: int, slot_of=lambda i, n: n - 1 - i) -> list[torch.Tensor]:
    """n streams, stream i of 5 + 7i patches joining at step i, stepped together until all finish
    -> per stream its (patches, 4, 64) latents. A paged cache is checked for disjoint pages every step."""
    prompt = model.encode_prompt(None)
    streams, outs = [], [[] for _ in range(n)]
    for step in range(2000):
        if step < n:
            toks = model.tokens(TEXTS[step], "English", prompt)
            length = 5 + 7 * step
            params = GenerationParams(seed=step, max_patches=length, min_patches=length)
            streams.append(gen.new_stream(slot_of(step, n), toks, prompt, params))
            if isinstance(gen.cache, PagedCache):
                assert gen.cache.blocks.reserve(streams[-1].slot, streams[-1].positions_needed())
        live = [s for s in streams if not s.finished]
        if not live and len(streams) == n:
            break
        for s, r in zip(live, gen.step(live)):
            if r.latents is not None:
                outs[streams.index(s)].append(r.latents)
        if isinstance(gen.cache, PagedCache):
            check_disjoint(gen.cache)
            for s in streams:
                if s.finished and gen.cache.blocks.reserved[s.slot]:
                    gen.cache.blocks.release(s.slot)
    return [torch.stack(o) for o in outs]


def run_to_end(service, stream_id: int) -> list:
    """Step one stream of a :class:`~engine.streams.GeneratorService` alone until its last chunk -> its chunks."""
    chunks = []
    while not chunks or not chunks[-1].last:
        chunk = service.step([stream_id])[stream_id]
        if chunk is not None:
            chunks.append(chunk)
    return chunks
