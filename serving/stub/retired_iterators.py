"""Decoupled BLS response iterators, let go of only after Triton's stub has let go of them (docs/triton.md#T18).

The stub's table of open BLS streams lets go of a decoupled call's ``ResponseIterator`` on its stub-to-parent thread,
without the GIL; were that the last reference, the heap would be corrupted (docs/triton.md#T18).

That thread serves its queue in order, and ``request.is_cancelled()`` waits for its own turn in the same queue.
So once such a call, begun after an iterator was retired, has been answered by the queue (it returned False: a
True is cached by the stub and waits for nothing), the table's reference is gone and ours is the last one; it
is dropped here, on the event loop, with the GIL. No Triton here: ``request`` is anything with ``is_cancelled()``.
"""

from __future__ import annotations

import asyncio


class RetiredIterators:
    """Response iterators that the code reading them is done with, held until the stub has let them go.
    Used from one event loop only (the stub's)."""

    def __init__(self):
        self.held: list = []  # iterators retired since the last call that went through the stub's queue

    def retire(self, iterator, reading: asyncio.Future | None = None) -> None:
        """Hold ``iterator`` until the stub has let it go; ``reading``: a read of it still running on a
        thread (its final read queues the stub's release), after which it is held."""
        if reading is None or reading.done():
            self.held.append(iterator)
        else:
            reading.add_done_callback(lambda _: self.held.append(iterator))

    def is_cancelled(self, request) -> bool:
        """``request.is_cancelled()``; when the stub's queue answered it, the iterators retired before it are
        let go (here, with the GIL)."""
        held, self.held = self.held, []
        try:
            cancelled = request.is_cancelled()
        except BaseException:
            self.held[:0] = held
            raise
        if cancelled:  # maybe the stub's cached answer: nothing went through its queue
            self.held[:0] = held
        return cancelled


RETIRED = RetiredIterators()  # the stub's table is one per process, and so is this
