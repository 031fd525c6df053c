"""Who holds the generator's slots, who steps now, and what each request handed to the generator means.

Plain Python over ints (no torch, no Triton), so every admission path is unit-tested in milliseconds.
The tensor side (:class:`~engine.streams.GeneratorService`) builds a stream's state, asks
:meth:`Scheduler.schedule` which rows to step, runs them, and calls :meth:`Scheduler.finish` for the
streams that ended.

- **Slots**: a stream holds one from :meth:`admit` to :meth:`finish`; free slots are a FIFO queue (a
  just-freed row is the last to be reused).
- **Pages** (:class:`~engine.block_manager.BlockManager`, which the scheduler owns): a stream reserves
  every KV-cache page it may need before it runs. One that fits the pool but not now is admitted
  *waiting*; :meth:`schedule` starts waiting streams in arrival order as pages come back, never one ahead
  of an older one, and takes the pages each running stream's step writes (its prefix on its first step,
  one position on each later one): the :class:`StepPlan` carries them to the cache's page table.
- **Requests** (:meth:`refusal`): a new stream needs an id of its own; the caller (the generator's
  engine thread) admits new streams only while a slot is free.

A stream's phase (text or audio) is not the scheduler's: it lives on the stream
(:class:`engine.generator_state.Phase`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager


@dataclass
class StreamState:
    """One live stream, as the scheduler sees it."""

    stream_id: int
    slot: int  # its page-table row; also the row of its generation state
    positions: int  # KV-cache positions it reserves: prompt + max_patches
    prefix: int  # positions its first step writes (the prompt); every later step writes one
    length: int = 0  # positions it holds after its last planned step
    waiting: bool = True  # admitted, its pages not reserved yet: not stepped


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: the rows the model runs and the streams that sit it out."""

    run: list[int]  # stream ids to step, in the order asked, each RUNNING
    waiting: list[int]  # asked for but still waiting for pages: no chunk this step
    started: list[int]  # of ``run``: streams that got their pages in this plan
    pages: dict[int, list[tuple[int, int]]]  # slot -> (page-table index, page) taken for this step's keys


class Scheduler:
    """Slots, page reservations and the page queue of up to ``slots`` streams.

    ``blocks`` is the KV cache's page bookkeeping, owned here; None for a cache whose rows already hold
    ``max_len`` (every stream that fits a row starts at once, and plans carry no pages).
    """

    def __init__(self, slots: int, blocks: BlockManager | None = None):
        if slots < 1:
            raise ValueError("need at least one slot")
        if blocks is not None and blocks.slots < slots:
            raise ValueError(f"the KV cache has {blocks.slots} page-table rows for {slots} slots")
        self.slots, self.blocks = slots, blocks
        self.free: deque[int] = deque(range(slots))
        self.streams: dict[int, StreamState] = {}
        self.queue: deque[int] = deque()  # waiting for pages, oldest first

    # -- streams --------------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.streams)

    def next_slot(self, stream_id: int) -> int:
        """The slot :meth:`admit` gives ``stream_id`` (ValueError: id live; RuntimeError: no free slot)."""
        if stream_id in self.streams:
            raise ValueError("this stream id is already live")
        if not self.free:
            raise RuntimeError(f"all {self.slots} generator slots are in use")
        return self.free[0]

    def admit(self, stream_id: int, positions: int, prefix: int) -> StreamState:
        """Give ``stream_id`` the next slot; it runs as soon as the pages for ``positions`` are reserved
        (now, unless the pool is short or an older stream waits); its first step writes ``prefix``
        positions. ValueError when it can never fit (nothing is kept), RuntimeError when no slot is free."""
        if not 0 < prefix <= positions:
            raise ValueError(f"a stream's prefix of {prefix} positions must be in 1..{positions}")
        slot = self.next_slot(stream_id)
        if self.blocks is not None:
            self.blocks.check_fits(positions)
        self.free.popleft()
        state = self.streams[stream_id] = StreamState(stream_id, slot, positions, prefix)
        self.queue.append(stream_id)
        self._start_waiting()
        return state

    def finish(self, stream_id: int) -> bool:
        """Free the stream's slot and pages (ended, cancelled or failed). False if it was not live."""
        state = self.streams.pop(stream_id, None)
        if state is None:
            return False
        if state.waiting:
            self.queue.remove(stream_id)
        elif self.blocks is not None:
            self.blocks.release(state.slot)
        self.free.append(state.slot)
        return True

    def schedule(self, stream_ids: list[int]) -> StepPlan:
        """The plan for one step over the live ``stream_ids`` (KeyError for one that is not live): who
        runs, and the pages each running stream takes for the keys this step writes. The caller runs
        every stream of ``run`` exactly once."""
        started = set(self._start_waiting())
        states = [self.streams[i] for i in stream_ids]
        running = [s for s in states if not s.waiting]
        pages = {}
        for s in running:
            s.length = s.prefix if s.length == 0 else s.length + 1
            if self.blocks is not None and (new := self.blocks.grow(s.slot, s.length)):
                pages[s.slot] = new
        return StepPlan(
            run=[s.stream_id for s in running],
            waiting=[s.stream_id for s in states if s.waiting],
            started=[s.stream_id for s in states if s.stream_id in started],
            pages=pages,
        )

    def _start_waiting(self) -> list[int]:
        started = []
        while self.queue:
            state = self.streams[self.queue[0]]
            if self.blocks is not None and not self.blocks.reserve(state.slot, state.positions):
                break
            state.waiting = False
            started.append(self.queue.popleft())
        return started

    # -- requests -------------------------------------------------------------------------------------
    def refusal(self, stream_id: int) -> str:
        """Why a new stream with ``stream_id`` cannot be admitted (the message for its sender), or ""."""
        if not stream_id:
            return "a generator stream needs a correlation id"
        if stream_id in self.streams:  # the live stream with this id is left alone
            return "this correlation id is in use"
        return ""
