"""Who holds the generator's slots, who steps now, and what each request handed to the generator means.

Plain Python over ints (no torch, no Triton), so every admission path is unit-tested in milliseconds.
The tensor side (:class:`~engine.streams.GeneratorService`) builds a stream's state, asks
:meth:`Scheduler.schedule` which rows to step, runs them, and calls :meth:`Scheduler.finish` for the
streams that ended.

- **Slots**: a stream holds one from :meth:`admit` to :meth:`finish`; free slots are a FIFO queue (a
  just-freed row is the last to be reused).
- **Pages** (:class:`~engine.block_manager.BlockManager`): a stream reserves every KV-cache page it may
  need before it runs. One that fits the pool but not now is admitted *waiting*; :meth:`schedule` starts
  waiting streams in arrival order as pages come back, never one ahead of an older one.
- **Requests** (:meth:`decide`, then :meth:`admission` for new ones): what a request means for the
  streams we hold. A queueing server (Triton's sequence batcher) may think a slot is free before our
  stream in it is gone; such a new stream is told to WAIT (rescheduled, sent nothing) and is remembered
  as *deferred*, because it comes back without its START flag.
- **Attendance** (:meth:`orphans`): every live stream comes back in the very next batch; one missing from
  ``MISSED_EXECUTES`` batches in a row (and ``MISSED_SECONDS``), or absent ``ORPHAN_SECONDS`` however
  few batches ran, is gone: the caller frees it. After a pause of the whole machine (:meth:`resume`)
  absence counts from then on.

A stream's phase (text or audio) is not the scheduler's: it lives on the stream
(:class:`engine.generator_state.Phase`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager

MISSED_EXECUTES, MISSED_SECONDS = 3, 0.5
ORPHAN_SECONDS = 10.0  # also without batches in between (the caller checks on a timer)
PAUSE_SECONDS = 3.0  # a 1 s timer tick this late means the whole machine stopped (a VM pause): see resume()
DEFERRED_SECONDS = 60.0  # a deferred stream whose client left never comes back: forgotten after this


class Action(enum.Enum):
    """What to do with one request."""

    STEP = "step"  # a live stream: step it (maybe not now: see StepPlan.waiting)
    CANCEL = "cancel"  # a live stream whose client left: end it now, with a cancelled last chunk
    NEW = "new"  # not a live stream's next step: authenticate it, then ask admission()
    ADMIT = "admit"  # a new stream and a free slot: build its state, then admit()
    WAIT = "wait"  # a new stream while every slot is ours: reschedule it, send nothing
    REFUSE = "refuse"  # answer with an error (Decision.why), keep nothing


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str = ""  # REFUSE: the message for the request's sender (bad input)


@dataclass
class StreamState:
    """One live stream, as the scheduler sees it."""

    stream_id: int
    slot: int  # its page-table row; also the row of its generation state
    positions: int  # KV-cache positions it reserves: prompt + max_patches
    waiting: bool = True  # admitted, its pages not reserved yet: not stepped
    seen: float | None = None  # when a batch last had its request (None: not yet counted)
    missed: int = 0  # batches in a row without it


@dataclass(frozen=True)
class StepPlan:
    """One step, decided: the rows the model runs and the streams that sit it out."""

    run: list[int]  # stream ids to step, in the order asked, each RUNNING
    waiting: list[int]  # asked for but still waiting for pages: no chunk this step
    started: list[int]  # of ``run``: streams that got their pages in this plan


class Scheduler:
    """Slots, page reservations and the waiting queue of up to ``slots`` streams.

    ``blocks`` is the KV cache's page bookkeeping; None for a cache whose rows already hold ``max_len``
    (every stream that fits a row starts at once).
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
        self.deferred: dict[int, float] = {}  # new streams told to WAIT -> since when

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

    def admit(self, stream_id: int, positions: int) -> StreamState:
        """Give ``stream_id`` the next slot; it runs as soon as the pages for ``positions`` are reserved
        (now, unless the pool is short or an older stream waits). ValueError when it can never fit (nothing
        is kept), RuntimeError when no slot is free."""
        slot = self.next_slot(stream_id)
        if self.blocks is not None:
            self.blocks.check_fits(positions)
        self.free.popleft()
        state = self.streams[stream_id] = StreamState(stream_id, slot, positions)
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
        """The plan for one step over the live ``stream_ids`` (KeyError for one that is not live)."""
        started = set(self._start_waiting())
        states = [self.streams[i] for i in stream_ids]
        return StepPlan(
            run=[s.stream_id for s in states if not s.waiting],
            waiting=[s.stream_id for s in states if s.waiting],
            started=[s.stream_id for s in states if s.stream_id in started],
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
    def decide(self, stream_id: int, start: bool, cancelled: bool = False) -> Decision:
        """A request for ``stream_id`` (``start``: it opens a sequence; ``cancelled``: its client asked to
        stop). Live streams' next steps need no authentication; everything else is NEW."""
        if stream_id in self.streams and not start:
            return Decision(Action.CANCEL if cancelled else Action.STEP)
        return Decision(Action.NEW)

    def admission(self, stream_id: int, start: bool, now: float) -> Decision:
        """An authenticated NEW request -> ADMIT, WAIT or REFUSE."""
        if not stream_id:
            return Decision(Action.REFUSE, "a generator stream needs a correlation id")
        if stream_id in self.streams:  # a START on a live id: the live stream is left alone
            return Decision(Action.REFUSE, "this correlation id is in use")
        if not self.free:
            # The queueing server thinks a slot is free: one of ours is gone and is freed within
            # MISSED_SECONDS (see orphans). Until then the new stream waits; it comes back without START.
            if start:
                self.deferred[stream_id] = now
            return Decision(Action.WAIT)
        if not (start or self.deferred.pop(stream_id, None) is not None):
            return Decision(Action.REFUSE, "this stream is not live (a new stream must start a sequence)")
        return Decision(Action.ADMIT)

    def forget_deferred(self, now: float, max_age: float = DEFERRED_SECONDS) -> None:
        """Drop deferred streams older than ``max_age`` seconds (their clients left)."""
        self.deferred = {i: t for i, t in self.deferred.items() if now - t <= max_age}

    # -- attendance -----------------------------------------------------------------------------------
    def orphans(self, present: list[int] | None, now: float) -> list[int]:
        """After a batch that held ``present`` (None: a check between batches) -> the live streams whose
        requests stopped coming. The caller frees them (:meth:`finish`)."""
        here = set(present) if present is not None else set()
        gone = []
        for state in self.streams.values():
            if state.stream_id in here:
                state.seen, state.missed = now, 0
                continue
            if state.seen is None:
                state.seen = now
            state.missed += present is not None
            absent = now - state.seen
            if (state.missed >= MISSED_EXECUTES and absent >= MISSED_SECONDS) or absent >= ORPHAN_SECONDS:
                gone.append(state.stream_id)
        return gone

    def resume(self, now: float) -> None:
        """After a pause of the whole machine: nobody was away, absence counts from ``now``."""
        for state in self.streams.values():
            if state.seen is not None:
                state.seen = now
