"""Work that outlives a cancelled caller, and the caller that must wait for it (no Triton)."""

from __future__ import annotations

import asyncio
import contextvars

# Work that outlives a cancelled caller (a stream's cleanup, a request on its way): a caller that must
# know when all of it is over (tts may release its request only then, since BLS requests it made still
# read that request's memory) sets a set here, and every such task of its context is added to it.
LINGERING: contextvars.ContextVar[set | None] = contextvars.ContextVar("lingering", default=None)


_ALIVE: set[asyncio.Task] = set()  # the event loop keeps only weak references to tasks


def linger(coro) -> asyncio.Task:
    """Run ``coro`` to its end even if whoever awaits it is cancelled; tracked in :data:`LINGERING`."""
    task = asyncio.ensure_future(coro)
    for tasks in (_ALIVE, LINGERING.get()):
        if tasks is not None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    return task


def unlinger(task: asyncio.Task) -> None:
    """Stop waiting for ``task`` at the end of this request (one that will never end: a BLS call Triton
    dropped); it stays alive, and referenced, until it ends."""
    tasks = LINGERING.get()
    if tasks is not None:
        tasks.discard(task)
