"""Streams of different lengths joining a generator one per step and stepped together: the workload the
paged-cache and attention-backend tests compare two generators on; and a service's stream run to its end."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.generator import Generator, StepResult, Stream
from engine.kv_cache import PagedCache
from engine.params import GenerationParams
from engine.scheduler import Scheduler

TEXTS = ["One", "Two words here", "Three little words and more", "Four", "five six seven eight", "x",
         "a longer text with many tokens in it", "b"]  # fmt: skip


class Planned:
    """A bare :class:`Generator`'s streams run as :class:`~engine.streams.GeneratorService` runs them: a
    :class:`Scheduler` owning a :class:`BlockManager` sized to the generator's cache reserves each
    stream's pages when it is admitted, and each step's plan takes the pages that step writes and hands
    them to :meth:`Generator.step`. A cache without pages (the per-slot reference) gets a scheduler
    without them."""

    def __init__(self, gen: Generator):
        self.gen, c = gen, gen.cache
        paged = isinstance(c, PagedCache)
        self.blocks = BlockManager(c.slots, c.max_len, c.num_pages, c.page_size) if paged else None
        self.scheduler = Scheduler(c.slots, self.blocks)

    def admit(self, stream: Stream) -> None:
        """Admit a stream built in the slot the test chose (the scheduler is made to hand out that slot),
        its pages reserved now: the test's pool must hold it."""
        free = self.scheduler.free
        free.remove(stream.slot)
        free.appendleft(stream.slot)
        assert not self.scheduler.admit(id(stream), stream.positions_needed(), stream.prefix_length()).waiting

    def step(self, streams: list[Stream]) -> list[StepResult]:
        """One generator step under the scheduler's plan; streams that finish give their pages back."""
        plan = self.scheduler.schedule([id(s) for s in streams])
        results = self.gen.step(streams, plan.pages)
        for s in streams:
            if s.finished:
                self.scheduler.finish(id(s))
        return results


def check_disjoint(blocks: BlockManager, cache: PagedCache | None = None) -> None:
    """No page held twice, the zero page never handed out, none lost; ``cache``'s page table holds each
    slot's pages in order."""
    owned = [p for p in blocks.pages if p]
    flat = [page for p in owned for page in p]
    assert len(flat) == len(set(flat)), "a page is held by two streams"
    assert 0 not in flat, "the zero page was handed out"
    assert len(flat) + len(blocks.free_pages) == blocks.num_pages, "a page was lost or duplicated"
    assert len(set(blocks.free_pages)) == len(blocks.free_pages)
    if cache is not None:
        for slot, pages in enumerate(blocks.pages):
            if pages:
                assert cache.table[slot, : len(pages)].tolist() == pages, f"slot {slot}: table and pages differ"


def generate_together(gen: Generator, model, n: int, slot_of=lambda i, n: n - 1 - i) -> list[torch.Tensor]:
    """n streams, stream i of 5 + 7i patches joining at step i, stepped together until all finish
    -> per stream its (patches, 4, 64) latents. A paged cache is checked for disjoint pages every step."""
    prompt = model.encode_prompt(None)
    planned = Planned(gen)
    streams, outs = [], [[] for _ in range(n)]
    for step in range(2000):
        if step < n:
            toks = model.tokens(TEXTS[step], "English", prompt)
            length = 5 + 7 * step
            params = GenerationParams(seed=step, max_patches=length, min_patches=length)
            streams.append(gen.new_stream(slot_of(step, n), toks, prompt, params))
            planned.admit(streams[-1])
        live = [s for s in streams if not s.finished]
        if not live and len(streams) == n:
            break
        for s, r in zip(live, planned.step(live)):
            if r.latents is not None:
                outs[streams.index(s)].append(r.latents)
        if planned.blocks is not None:
            check_disjoint(planned.blocks, gen.cache)
    if planned.blocks is not None:
        assert planned.blocks.pages_in_use == 0 and planned.blocks.committed == 0
    return [torch.stack(o) for o in outs]


def run_to_end(service, stream_id: int) -> list:
    """Step one stream of a :class:`~engine.streams.GeneratorService` alone until its last chunk -> its chunks."""
    chunks = []
    while not chunks or not chunks[-1].last:
        chunk = service.step([stream_id])[stream_id]
        if chunk is not None:
            chunks.append(chunk)
    return chunks
