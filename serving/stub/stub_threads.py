"""The threads an async model's (``tts``, ``ensemble_generator``) blocking calls into Triton run on, off the
event loop: every BLS wait (docs/triton.md#T5) and the sends of its own responses (#T20)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading

SEND_THREADS = 8  # threads that send a model's responses (StubThreads.sends)
BLS_THREADS = 1024  # threads for BLS waits (StubThreads.pool)
WARM_EXTRA_THREADS = 32  # BLS threads started at load beyond one per generator slot (StubThreads.warm)
SENDS_AHEAD = 2  # a request's sends queued or under way before Responses.send waits (one sent, one next)
# how long an execute coroutine lives past its last request (docs/triton.md#T29): long enough for the stub's
# main thread to file the coroutine's future before it ends, even behind a busy event loop's hold on the GIL
SETTLE_SECONDS = 0.05


class StubThreads:
    """``pool`` for every blocking BLS wait (the event loop's default executor: docs/triton.md#T5), ``sends``
    for response sends (:class:`Responses`)."""

    def __init__(self, name: str):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=BLS_THREADS, thread_name_prefix=f"{name}-bls")
        # apart, so that BLS calls waiting on the pool's threads never hold them up; a few sends overlap
        self.sends = concurrent.futures.ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix=f"{name}-send")
        self.loop: asyncio.AbstractEventLoop | None = None

    def warm(self, threads: int, seconds: float = 30.0) -> bool:
        """Start ``threads`` of ``pool`` at load -> whether they all started within ``seconds`` (started on
        demand, a burst of new streams started them on the event loop: a tenth of ``tts``'s loop at 512)."""
        threads = min(threads, BLS_THREADS)  # more could never all wait at once: the barrier would time out
        barrier = threading.Barrier(threads + 1)
        for _ in range(threads):  # each waits at the barrier: none is idle, so each submit starts a thread
            self.pool.submit(barrier.wait, seconds)
        try:
            barrier.wait(seconds)
            return True
        except threading.BrokenBarrierError:
            return False  # fewer started: the rest start on demand

    async def serve(self, requests, serve_one) -> None:
        """``await serve_one(r)`` for every request of an ``execute``, together, on this pool."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            loop.set_default_executor(self.pool)
            self.loop = loop
        await asyncio.gather(*(serve_one(r) for r in requests))
        await asyncio.sleep(SETTLE_SECONDS)  # every response is out: the stub files this coroutine's future (T29)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sends.shutdown(wait=False, cancel_futures=True)


class Responses:
    """A request's response sender whose sends (a round trip each: docs/triton.md#T20) run on ``pool``, one
    at a time and in order, each going out even if its caller is cancelled. ``send`` returns while at most
    :data:`SENDS_AHEAD` are queued or under way (the caller makes its next chunk meanwhile); :meth:`final`
    goes after all of them. A send that failed is raised by the next ``send``."""

    def __init__(self, sender, pool):
        self.sender, self.pool = sender, pool
        self.sending: asyncio.Future | None = None  # the send under way
        self.queued: collections.deque = collections.deque()  # responses not started yet
        self.failed: BaseException | None = None

    def pending(self) -> int:
        """Sends queued or under way."""
        return len(self.queued) + (self.sending is not None and not self.sending.done())

    async def send(self, response) -> None:
        if self.failed is not None:
            raise self.failed
        self.queued.append(response)
        self._next()
        while self.pending() > SENDS_AHEAD:
            await asyncio.wait({self.sending})
        if self.failed is not None:
            raise self.failed

    async def final(self, response=None, flags: int = 0) -> None:
        """Send after every send queued or under way has ended (what they raised is their callers'); this
        one is finished before a cancellation of its caller is raised."""
        while self.pending():
            await asyncio.wait({self.sending})
        await finished(self._start(response, flags))

    def _next(self) -> None:
        """Start the next queued send once none is under way (on the event loop)."""
        if not self.queued or (self.sending is not None and not self.sending.done()):
            return
        self._start(self.queued.popleft(), 0).add_done_callback(self._sent)

    def _start(self, response, flags: int) -> asyncio.Future:
        """One send, on a pool thread: :attr:`sending` until it ends."""
        self.sending = asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(self.sender.send, response, flags=flags)
        )
        return self.sending

    def _sent(self, future: asyncio.Future) -> None:
        if future.cancelled():  # the pool shut down (the model unloads): nothing more goes out
            self.queued.clear()
            return
        if future.exception() is not None and self.failed is None:
            self.failed = future.exception()
        self._next()


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
