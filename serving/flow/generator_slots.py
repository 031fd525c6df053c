"""Generator slots, handed out before a stream is sent to the generator (by ``tts`` and ``ensemble_generator``).

A stream that waits for a slot in Triton's sequence batcher can be lost there (docs/triton.md#T14), and
the BLS call that sent it waits forever. So a stream waits here instead, in the process that will send it, and goes to the generator only when one of
its ``slots`` is free: the sequence batcher's backlog stays empty, and how long a stream may wait is
bounded by the admission gate (serving.flow.side_channel), not by Triton's idle timer.

The count is shared by both senders through a file in the run's cancellation folder, as the admission
gate's is (the same :class:`~serving.flow.admission.Admission`, with ``slots`` places). A sender takes a slot
before it sends a stream and gives it back once the generator has ended it (its last chunk, a cancel
answered, or the stream lost).

Read-ahead (a long text's later segments generating early, :class:`engine.orchestrator._ReadAhead`) comes
last: :meth:`GeneratorSlots.take_ahead` takes a slot only when one is free and no stream waits for one in any
sender (:func:`engine.segments.ahead_may_start`; the waiters are counted in a second file beside the slots'),
and :meth:`GeneratorSlots.starts_waiting` tells the orchestrator when its read-ahead segments must yield.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.segments import ahead_may_start
from serving.flow.admission import Admission

FILE = "generator_slots"
WAITERS_FILE = "generator_slot_waiters"  # streams (not read-ahead) waiting for a slot, per sender
POLL_SECONDS = 0.02  # how often the first waiter of a process looks for a free slot


class GeneratorSlots:
    """``slots`` places shared by every process that sends streams to the generator; ``model`` is this one
    (one of :data:`serving.flow.admission.ADMITTERS`)."""

    def __init__(self, board: str | Path, model: str, slots: int):
        self.gate = Admission(board, model, slots, file=FILE)
        self.gate.clear()  # one instance per model: slots a dead server held are nobody's (no deadlock on them)
        self.waiters = Admission(board, model, 2**62, file=WAITERS_FILE)
        self.waiters.clear()
        self.turn = asyncio.Lock()  # this process's waiters, first come first served

    async def take(self) -> None:
        """Wait until a slot is free and take it (cancellable: nothing is taken then). A stream that waits
        is counted in :meth:`starts_waiting` meanwhile: read-ahead segments yield it their slots."""
        if not self.turn.locked() and self.gate.enter():
            return
        self.waiters.enter()
        try:
            async with self.turn:
                while not self.gate.enter():
                    await asyncio.sleep(POLL_SECONDS)
        finally:
            self.waiters.leave()

    def take_ahead(self) -> bool:
        """Take a slot for a read-ahead segment, at once or never: only when one is free and no stream
        waits for one (:func:`engine.segments.ahead_may_start`). False: nothing taken."""
        return ahead_may_start(self.free_slots(), self.starts_waiting()) and self.gate.enter()

    def free_slots(self) -> int:
        return max(0, self.gate.capacity - self.gate.total())

    def starts_waiting(self) -> int:
        """Streams waiting for a slot in every sender (read-ahead segments never wait)."""
        return self.waiters.total()

    def give_back(self) -> None:
        self.gate.leave()

    def held(self) -> int:
        """Slots held by every sender together."""
        return self.gate.total()
