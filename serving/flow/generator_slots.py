"""Generator slots, handed out before a stream is sent to the generator (by ``tts`` and ``ensemble_generator``).

A stream that waits for a slot in Triton's sequence batcher can be lost there (docs/triton.md#T14), and
the BLS call that sent it waits forever. So a stream waits here instead, in the process that will send it, and goes to the generator only when one of
its ``slots`` is free: the sequence batcher's backlog stays empty, and how long a stream may wait is
bounded by the admission gate (serving.flow.side_channel), not by Triton's idle timer.

The count is shared by both senders through a file in the run's cancellation folder, as the admission
gate's is (the same :class:`~serving.flow.side_channel.Admission`, with ``slots`` places). A sender takes a slot
before it sends a stream and gives it back once the generator has ended it (its last chunk, a cancel
answered, or the stream lost).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from serving.flow.side_channel import Admission

FILE = "generator_slots"
POLL_SECONDS = 0.02  # how often the first waiter of a process looks for a free slot


class GeneratorSlots:
    """``slots`` places shared by every process that sends streams to the generator; ``model`` is this one
    (one of :data:`serving.flow.side_channel.ADMITTERS`)."""

    def __init__(self, board: str | Path, model: str, slots: int):
        self.gate = Admission(board, model, slots, file=FILE)
        self.gate.clear()  # one instance per model: slots a dead server held are nobody's (no deadlock on them)
        self.turn = asyncio.Lock()  # this process's waiters, first come first served

    async def take(self) -> None:
        """Wait until a slot is free and take it (cancellable: nothing is taken then)."""
        async with self.turn:
            while not self.gate.enter():
                await asyncio.sleep(POLL_SECONDS)

    def give_back(self) -> None:
        self.gate.leave()

    def held(self) -> int:
        """Slots held by every sender together."""
        return self.gate.total()
