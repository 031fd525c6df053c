"""The BLS transport of an async model (``tts``, ``ensemble_generator``): calls and streams to the other
Triton models, and the watch over a running request (its client, the launcher's flags: :func:`watch_request`).

``pb`` is ``triton_python_backend_utils``, passed in because it only exists inside the stub. Every call
has a timeout whose error names the model. A decoupled BLS stream is iterated on a thread (``next``
blocks), never on the event loop's small default executor. The orchestrator's interfaces over this
transport are in :mod:`serving.stub.bls_adapters`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from engine.lifetime import CANCEL_POLL_SECONDS, linger, watch
from engine.protocol import UNAVAILABLE, StreamFailed, Unavailable, error_kind
from serving.stub.cancel_watch import CANCELS
from serving.stub.retired_iterators import RETIRED
from serving.stub.triton_io import bls_error

log = logging.getLogger("tts")
LOST_POLL_SECONDS = 0.25  # how often a stream waiting for the generator asks whether it was lost
# ... and all of them together at most this often (each asks by a wake-up of the event loop, a timeout and a
# file check: 512 streams every 0.25 s cost ~0.03 ms of CPU per stream-step); 512 streams: each every 1.3 s
LOST_CHECKS_PER_SECOND = 400
DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"


class PolledFlags:
    """The launcher's ``broken`` flag (serving.supervision.run_folder.RunFlags) as every running request of a model
    polls it in :func:`watch_request`: read from its file at most once per ``seconds`` for all of them (256
    streams polled one open() each, 5,000 a second). Used from one event loop only."""

    def __init__(self, flags, seconds: float = CANCEL_POLL_SECONDS):
        self.flags, self.seconds = flags, seconds
        self.read_at, self.value = -float("inf"), None

    def broken(self) -> str | None:
        now = time.monotonic()
        if now - self.read_at >= self.seconds:
            self.value, self.read_at = self.flags.broken(), now
        return self.value


async def watch_request(task: asyncio.Task, request, flags, lingering: set,
                        stop: Callable[[], bool] | None = None) -> str | None:  # fmt: skip
    """:func:`engine.lifetime.watch` for a Triton ``request`` served by ``task``: its client's leaving is
    ``request.is_cancelled()``, asked on the stub's watch thread (:data:`serving.stub.cancel_watch.CANCELS`,
    through :data:`RETIRED`: docs/triton.md#T18), the server's breaking ``flags.broken()``
    (:class:`PolledFlags` or ``serving.supervision.run_folder.RunFlags``). The caller sends the final response
    after this returns: after the last ``is_cancelled()`` (docs/triton.md#T3) and the cleanup, whose BLS
    requests must outlive their tasks (docs/triton.md#T4). ``stop()`` true ends the task as a client's leaving
    does (a paced request held past its bound: serving.flow.pacing)."""
    entry = CANCELS.add(request)
    broken = None
    left = (lambda: entry.cancelled) if stop is None else (lambda: entry.cancelled or stop())
    try:
        broken = await watch(task, left, flags.broken, lingering)
    finally:  # the iterators this request's streams left (T18) are let go by the watch's last call
        await CANCELS.remove(entry, last=broken is None)
    return broken


class BLS:
    """What the three clients share: ``pb``, the timeout, the thread pool for stream iteration and the
    request parameters that mark a request as ours (:class:`serving.security.auth.Keys`)."""

    def __init__(self, pb, timeout: float, pool, parameters: dict[str, str] | None = None, flags=None):
        self.pb, self.timeout, self.pool, self.parameters = pb, timeout, pool, dict(parameters or {})
        self.flags = flags  # serving.supervision.run_folder.RunFlags: a call to a model whose stub died ends at once

    def submit(self, request, **kw) -> asyncio.Task:
        """``request.async_exec(**kw)`` as a task that runs to its end whatever happens to the caller (who
        awaits it shielded): a request cut short is freed while Triton still reads it (docs/triton.md#T4)."""

        async def run():
            return await request.async_exec(**kw)  # this frame keeps the request alive until it is sent

        return linger(run())

    def raise_for(self, model: str, response) -> None:
        error = bls_error(self.pb, model, response)
        if error is not None:
            raise error

    async def call(self, model: str, inputs: list, outputs: list[str], decoupled: bool = False) -> dict:
        """One request, one response; ``decoupled``: the model answers with one final response."""
        request = self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                           parameters=self.parameters, timeout=int(self.timeout * 1e6))  # fmt: skip

        async def exchange():  # this frame keeps the request alive until its response is in
            if not decoupled:
                return await request.async_exec()
            responses = await request.async_exec(decoupled=True)
            try:  # Triton returns the iterator with the first response in it: reading it does not block (T26)
                return next(responses)
            finally:
                RETIRED.retire(responses)  # held until the stub has let go of it: docs/triton.md#T18

        task, deadline = linger(exchange()), time.monotonic() + self.timeout
        while not task.done():  # left to run whatever happens here (the request must outlive its exchange)
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"{model} did not answer within {self.timeout:.0f} s")
            await asyncio.wait({task}, timeout=min(left, DEAD_POLL_SECONDS))
            # a stub that died mid-request never answers it; the launcher says so (serving.supervision.supervise)
            if not task.done() and self.flags is not None and (dead := self.flags.dead(model)):
                raise Unavailable(error_kind(dead)[1])
        response = task.result()
        self.raise_for(model, response)
        return {n: self.pb.get_output_tensor_by_name(response, n).as_numpy() for n in outputs}


_reading = 0  # streams waiting in ResponseStream.next now (the stub's one event loop runs them all)


def lost_poll_seconds(reading: int) -> float:
    """How often each of ``reading`` streams waiting for a response asks whether it was lost."""
    return max(LOST_POLL_SECONDS, reading / LOST_CHECKS_PER_SECOND)


class ResponseStream:
    """A decoupled BLS response iterator, read on a thread, ahead of the caller: as soon as one response
    is read the next read starts, and what is read waits in :attr:`ahead` until :meth:`next` takes it. So
    with read receipts (``receipt``, serving.flow.receipts.Receipt: each response counted on the reading
    thread the moment it is read) the model sends the next response as soon as the last one has arrived,
    not when the caller gets round to it: pacing by receipts (docs/triton.md#T23) adds no wait to a
    caller that is behind. One read runs at a time: a wait cut short (timeout, cancellation) leaves it
    running, and the next ``next`` waits for it again. The receipt is closed once no read runs any more
    after :meth:`close`."""

    def __init__(self, bls: BLS, model: str, responses, receipt=None):
        self.bls, self.model, self.responses, self.receipt = bls, model, responses, receipt
        self.pending: asyncio.Future | None = None  # the read running on a thread, if any
        self.ahead: deque = deque()  # responses read and not taken yet (None: the stream's end)
        self.closed = False

    def _read_next(self) -> asyncio.Future:
        self.pending = asyncio.get_running_loop().run_in_executor(self.bls.pool, _read, self.responses, self.receipt)
        self.pending.add_done_callback(self._landed)
        return self.pending

    def _landed(self, read: asyncio.Future) -> None:
        """A read is back (on the event loop): keep its response and start the next read, unless the stream
        ended, failed (``next`` raises the error) or is closed."""
        if read is not self.pending or read.cancelled() or read.exception() is not None:
            return
        self.pending = None
        response = read.result()
        self.ahead.append(response)
        if response is not None and not self.closed:
            self._read_next()

    async def next(self, lost: Callable[[], bool] = lambda: False):
        """The next response, None at the end of the stream. StreamFailed as soon as ``lost()`` says the
        model has given the stream up (checked every LOST_POLL_SECONDS while waiting, less often when many
        streams wait: :func:`lost_poll_seconds`)."""
        if not self.ahead:
            read = self.pending or self._read_next()
            deadline = time.monotonic() + self.bls.timeout
            global _reading
            _reading += 1
            try:
                await self._wait(read, deadline, lost)
            finally:
                _reading -= 1
            if read.exception() is not None:  # this read failed: the next call reads again
                self.pending = None
                raise read.exception()
        return self.ahead.popleft()

    async def _wait(self, read: asyncio.Future, deadline: float, lost: Callable[[], bool]) -> None:
        # asyncio.wait leaves the read be when it times out or is cancelled (no shield, no exception per poll)
        while not read.done():
            await asyncio.wait({read}, timeout=lost_poll_seconds(_reading))
            if read.done():
                break
            if lost():
                raise StreamFailed(UNAVAILABLE + LOST)
            if time.monotonic() > deadline:
                # unavailable: the stream went astray in the server (Triton dropped it); a retry may work
                raise TimeoutError(f"{UNAVAILABLE}{self.model} sent nothing for {self.bls.timeout:.0f} s; retry")
        if not read.cancelled() and read.exception() is None and not self.ahead:
            self._landed(read)  # its callback has not run yet (it runs in the order callbacks were added)

    def close(self) -> None:
        """The stream is no longer read: no read starts any more, its iterator is let go of once the stub
        has (docs/triton.md#T18), and its receipt closed once the read still running, if any, has returned
        (until then the model must not send it two responses: docs/triton.md#T23)."""
        self.closed = True
        RETIRED.retire(self.responses, self.pending)
        if self.receipt is not None:
            if self.pending is None or self.pending.done():
                self.receipt.close()
            else:
                self.pending.add_done_callback(lambda _, receipt=self.receipt: receipt.close())


def _read(responses, receipt):
    """The next response of ``responses`` (None at the end), counted on ``receipt`` the moment it is read."""
    response = next(responses, None)
    if response is not None and receipt is not None:
        receipt.read()
    return response
