"""The BLS calls of ``tts`` and ``ensemble_generator`` (their orchestrator's interfaces: serving.stub.bls_adapters),
and the watch of a running request's ``is_cancelled()`` (T3, T18, T20; no Triton: a request is anything with that
method): docs/architecture.md, "Cancellation: one carrier"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine

from engine.lifetime import CANCEL_CHECKS_PER_SECOND, CANCEL_POLL_SECONDS, LINGERING, linger, watch
from engine.protocol import Unavailable, error_kind
from serving.flow.side_channel import SideChannel
from serving.stub.stub_threads import finished
from serving.stub.triton_io import bls_error
from serving.supervision.run_folder import BROKEN, DEAD

log = logging.getLogger("tts")
DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"


async def first_response(request):
    """Send a decoupled BLS request -> its first response (None: it had none). Triton returns the iterator
    with it, so reading it does not block (T26); the iterator is retired (T18)."""
    responses = await request.async_exec(decoupled=True)
    try:
        return next(responses, None)
    finally:
        RETIRED.retire(responses)  # held until the stub has let go of it


class BLS:
    """``pb``, the calls' timeout, the request parameters that mark a request as ours
    (:class:`serving.security.auth.Keys`) and the launcher's ``dead.<model>`` flags (``channel``)."""

    def __init__(self, pb, timeout: float, parameters: dict[str, str], channel: SideChannel):
        self.pb, self.timeout, self.parameters, self.channel = pb, timeout, dict(parameters), channel

    async def call(self, model: str, inputs: list, outputs: list[str], decoupled: bool = False) -> dict:
        """One request, one response; ``decoupled``: the model answers with one final response."""
        request = self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                           parameters=self.parameters, timeout=int(self.timeout * 1e6))  # fmt: skip

        # the task keeps the request alive until its response is in
        exchange = first_response(request) if decoupled else request.async_exec()
        task, deadline = linger(exchange), time.monotonic() + self.timeout
        while not task.done():  # left to run whatever happens here (the request must outlive its exchange)
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"{model} did not answer within {self.timeout:.0f} s")
            await asyncio.wait({task}, timeout=min(left, DEAD_POLL_SECONDS))
            # a stub that died mid-request never answers it; the launcher says so (serving.supervision.supervise)
            if not task.done() and (dead := self.channel.flag(f"{DEAD}{model}")):
                raise Unavailable(error_kind(dead)[1])
        if (error := bls_error(self.pb, model, response := task.result())) is not None:
            raise error
        return {n: self.pb.get_output_tensor_by_name(response, n).as_numpy() for n in outputs}


async def watch_request(request, run: Coroutine, channel, stop: Callable[[], bool] | None = None):
    """Run ``run`` as ``request``'s task until it ends, its client leaves (or ``stop()``: a paced request held
    past its bound) or the server breaks (the launcher's ``broken`` flag, ``channel.flag``) -> (the task, the
    breaking's reason or None). On None the task's cleanup has ended (its BLS requests outlive it: T4) and the
    watch thread has let go of the request (T3), so the caller's final response may follow."""
    lingering: set = set()
    LINGERING.set(lingering)  # this task's context, and so the request's task's
    task = asyncio.ensure_future(run)
    entry, broken = CANCELS.add(request), None
    left = (lambda: entry.cancelled) if stop is None else (lambda: entry.cancelled or stop())
    try:
        broken = await watch(task, left, lambda: channel.flag(BROKEN), lingering)
    finally:  # the iterators this request's streams left (T18) are let go by the watch's last call
        await CANCELS.remove(entry, last=broken is None)
    return task, broken


class RetiredIterators:
    """Decoupled BLS response iterators the code reading them is done with (retired on the event loop), held
    until Triton's stub has let go of them: until an ``is_cancelled()`` begun after they were retired came back
    False through the stub's queue, on the thread that asked, with the GIL (docs/triton.md#T18)."""

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
        cancelled = True
        try:
            cancelled = request.is_cancelled()
        finally:
            if cancelled:  # it raised, or maybe the stub's cached answer: nothing went through its queue
                with self.lock:
                    self.held[:0] = held
        return cancelled  # ``held`` is dropped on return: the last references, with the GIL


class Watched:
    """A request under watch: ``cancelled`` turns True (from the watch's thread) once its client left."""

    __slots__ = ("cancelled", "request")

    def __init__(self, request):
        self.request, self.cancelled = request, False


class CancelWatch:
    """The thread that asks ``is_cancelled()`` of the watched requests, one after another: each request
    about every ``max(poll, n / rate)`` seconds for n watched, never faster than ``rate`` calls a second in
    all. :meth:`add` and :meth:`remove` are called from event loops."""

    def __init__(self, rate: float = CANCEL_CHECKS_PER_SECOND, poll: float = CANCEL_POLL_SECONDS):
        self.rate, self.poll = rate, poll
        self.lock = threading.Lock()
        self.turn: deque[Watched] = deque()  # the requests in the order they are asked (the thread's)
        self.added: list[Watched] = []  # added since the thread last looked
        self.removals: list[tuple[Watched, bool, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, request) -> Watched:
        entry = Watched(request)
        with self.lock:
            self.added.append(entry)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
                self.thread.start()
        return entry

    async def remove(self, entry: Watched, last: bool) -> None:
        """Stop watching ``entry``; returns once the thread will never touch its request again, having asked
        it once more if ``last`` and retired iterators wait for such a call (T18). A cancellation meanwhile
        is raised once that is so: the caller's final response must not overtake the thread's last call."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self.lock:
            self.removals.append((entry, last, loop, done))
        self.wake.set()
        await finished(done)

    def _run(self) -> None:
        next_at = 0.0  # when the next question may be asked (a removal wakes the thread, not the questions)
        while True:
            self._take()
            n, now = len(self.turn), time.monotonic()
            if not n or now < next_at:
                self.wake.wait(1.0 if not n else next_at - now)
                self.wake.clear()
                continue
            entry = self.turn.popleft()
            self._ask(entry)
            self.turn.append(entry)
            next_at = now + max(self.poll / n, 1.0 / self.rate)

    def _take(self) -> None:
        """Take the requests added and removed since the last look (the removed ones let go here)."""
        with self.lock:
            added, self.added = self.added, []
            removals, self.removals = self.removals, []
        self.turn.extend(added)
        if not removals:
            return
        removed = {id(entry) for entry, *_ in removals}
        self.turn = deque(e for e in self.turn if id(e) not in removed)
        for entry, last, loop, done in removals:
            if last and RETIRED.held:  # the iterators its streams left (T18): let go of them now
                self._ask(entry)
            entry.request = None  # never asked again (T3)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                loop.call_soon_threadsafe(lambda done=done: done.done() or done.set_result(None))

    @staticmethod
    def _ask(entry: Watched) -> None:
        try:
            entry.cancelled |= RETIRED.is_cancelled(entry.request)  # once True, it stays
        except Exception:  # noqa: BLE001 (a failed check is not a cancellation; the next one may work)
            log.exception("is_cancelled() failed")


RETIRED = RetiredIterators()  # the stub's table is one per process, and so is this
CANCELS = CancelWatch()  # one per stub process, like the stub's queue it asks through
