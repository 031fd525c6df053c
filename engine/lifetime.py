"""A request's lifetime and the cleanup it leaves: :func:`watch` runs a request's task until it ends, its
client leaves, or the server breaks, and then waits for the work the task left behind (:func:`linger`). No
Triton: the checks are callables (``serving.stub.bls.watch_request`` binds them to a Triton request), so the
orchestrator, which lingers its streams' cleanup, stays free of ``serving``.

Why a request waits for its cleanup: BLS requests made on its behalf still read its memory until they end
(docs/triton.md#T4), so ``tts`` may send its final response only once all of that work is over.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

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


CANCEL_POLL_SECONDS = 0.05  # how often a running request checks whether its client went away
# ... and all running requests of a process together at most this often: a check may be a round trip to
# another process (Triton's is_cancelled(): docs/triton.md#T20). 512 streams: each every 2.6 s, the
# longest a slot stays held after its client left.
CANCEL_CHECKS_PER_SECOND = 200
_watching = 0  # requests in watch() now: one event loop runs them all


def cancel_poll_seconds(watching: int) -> float:
    """How often each of ``watching`` running requests asks whether its client left."""
    return max(CANCEL_POLL_SECONDS, watching / CANCEL_CHECKS_PER_SECOND)


async def watch(task: asyncio.Task, cancelled: Callable[[], bool], broken: Callable[[], str | None],
                lingering: set) -> str | None:  # fmt: skip
    """Wait for ``task``, which serves a request, and for the cleanup it leaves (``lingering``, the set the
    request's context holds in :data:`LINGERING`).

    ``cancelled()`` true (the client left) cancels the task (again each poll: Python 3.11's ``wait_for``
    can swallow one cancellation). Returns None once all is over, so that the caller sends the final
    response; or, at once, what ``broken()`` says when the server is about to be replaced (the task
    cancelled, its cleanup not waited for)."""
    global _watching
    _watching += 1
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=cancel_poll_seconds(_watching))
            if not task.done() and cancelled():
                task.cancel()
            if not task.done() and (message := broken()):
                task.cancel()
                return message
    finally:
        _watching -= 1
    while lingering:
        await asyncio.wait(set(lingering))
    return None
