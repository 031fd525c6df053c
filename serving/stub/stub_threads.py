"""The threads an async model's blocking calls into Triton run on (``tts``, ``ensemble_generator``).

:class:`StubThreads` holds every blocking BLS wait of a stub (docs/triton.md#T5) and the sends of its own
responses (:class:`Responses`), so that neither holds up the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

SEND_THREADS = 8  # threads that send a model's responses (StubThreads.sends)


class StubThreads:
    """An async model's two thread pools: ``pool`` for every blocking BLS wait (iterating a decoupled
    stream, and ``async_exec`` itself, which uses the event loop's default executor: docs/triton.md#T5),
    ``sends`` for its response sends (:class:`Responses`)."""

    def __init__(self, name: str):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1024, thread_name_prefix=f"{name}-bls")
        # response sends (:class:`Responses`): apart, so that streams blocked reading the pool's threads
        # never hold them up; each takes a round trip, so a few overlap
        self.sends = concurrent.futures.ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix=f"{name}-send")
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, requests, serve_one) -> None:
        """``await serve_one(r)`` for every request of an ``execute``, together, on this pool."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            loop.set_default_executor(self.pool)
            self.loop = loop
        await asyncio.gather(*(serve_one(r) for r in requests))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sends.shutdown(wait=False, cancel_futures=True)


class Responses:
    """A request's response sender whose ``send`` runs on a pool thread: the round trip to Triton's process
    (docs/triton.md#T20) no longer holds up the event loop, and the sends of different requests
    overlap. One request's sends go out one at a time, in order (each awaited before the next), and a
    send once started is finished before its caller sees a cancellation: a final response can never
    overtake a chunk still being sent (:meth:`final` waits for it)."""

    def __init__(self, sender, pool):
        self.sender, self.pool = sender, pool
        self.sending: asyncio.Future | None = None

    async def send(self, response=None, flags: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self.sending = loop.run_in_executor(self.pool, functools.partial(self.sender.send, response, flags=flags))
        await finished(self.sending)

    async def final(self, response=None, flags: int = 0) -> None:
        """``send`` after the send in flight, if any, has ended (what it raised is its caller's)."""
        if self.sending is not None and not self.sending.done():
            await asyncio.wait({self.sending})
        await self.send(response, flags)


async def finished(future: asyncio.Future):
    """``await future``, which a thread completes; a cancellation meanwhile is raised once it has ended."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()
