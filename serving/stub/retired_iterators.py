"""Decoupled BLS response iterators, let go of only after Triton's stub has let go of them: after an
``is_cancelled()`` begun once they were retired came back False through the same stub queue, on the thread that
asked, with the GIL (docs/triton.md#T18; serving.stub.cancel_watch asks). No Triton here: ``request`` is anything
with ``is_cancelled()``.
"""

from __future__ import annotations

import threading


class RetiredIterators:
    """Response iterators that the code reading them is done with, held until the stub has let them go.
    Retired on the stub's event loop, let go on whichever thread asks ``is_cancelled()``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: list = []  # iterators retired since the last call that went through the stub's queue

    def retire(self, iterator) -> None:
        """Hold ``iterator`` (read to its end, or never to be read again) until the stub has let it go."""
        with self.lock:
            self.held.append(iterator)

    def is_cancelled(self, request) -> bool:
        """``request.is_cancelled()``; when the stub's queue answered it, the iterators retired before it are
        let go (here, with the GIL)."""
        with self.lock:
            held, self.held = self.held, []
        try:
            cancelled = request.is_cancelled()
        except BaseException:
            self._keep(held)
            raise
        if cancelled:  # maybe the stub's cached answer: nothing went through its queue
            self._keep(held)
        return cancelled  # ``held`` is dropped on return: the last references, with the GIL

    def _keep(self, held: list) -> None:
        with self.lock:
            self.held[:0] = held


RETIRED = RetiredIterators()  # the stub's table is one per process, and so is this
