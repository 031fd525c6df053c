"""The orchestrator's interfaces as async BLS calls to the Triton models (used by the ``tts`` model).

``pb`` is ``triton_python_backend_utils``, passed in because it only exists inside the stub. Every call
has a timeout whose error names the model. A decoupled BLS stream is iterated on a thread (``next``
blocks), never on the event loop's small default executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from engine.orchestrator import Segment, linger, unlinger
from engine.protocol import LATENT_DIM, UNAVAILABLE, Chunk, StreamFailed, Unavailable, error_kind
from serving import contract
from serving.cancel import CancelBoard
from serving.generator_slots import GeneratorSlots
from serving.requests import Voice, generator_parameters
from serving.retired_iterators import RETIRED
from serving.triton_io import bls_error, read_chunk, tensors

log = logging.getLogger("tts")
LOST_POLL_SECONDS = 0.25  # how often a stream waiting for the generator asks whether it was lost
# ... and all of them together at most this often (each asks by a wake-up of the event loop, a timeout and a
# file check: 512 streams every 0.25 s cost ~0.03 ms of CPU per stream-step); 512 streams: each every 1.3 s
LOST_CHECKS_PER_SECOND = 400
DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"
SEND_THREADS = 8  # threads that send a model's responses (Waits.sends)


class Waits:
    """The thread pool for every blocking BLS wait of an async model (iterating a decoupled stream, and
    ``async_exec`` itself, which uses the event loop's default executor: docs/triton.md#T5)."""

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


CANCEL_POLL_SECONDS = 0.05  # how often a running request checks whether its client went away
# request.is_cancelled() is a round trip to Triton's process (~0.5 ms, the event loop blocked meanwhile, and
# CPU in both processes): all of a stub's running requests together ask at most this often. 512 streams:
# each every 2.6 s, the longest a slot stays held after its client left; 1,000 a second cost a 2-core
# machine ~0.1 ms of CPU per stream-step at 128 streams and half of tts's event loop.
CANCEL_CHECKS_PER_SECOND = 200
_watching = 0  # requests in watch() now: the stub's one event loop runs them all


def cancel_poll_seconds(watching: int) -> float:
    """How often each of ``watching`` running requests asks whether its client left."""
    return max(CANCEL_POLL_SECONDS, watching / CANCEL_CHECKS_PER_SECOND)


class Responses:
    """A request's response sender whose ``send`` runs on a pool thread: the round trip to Triton's process
    (~1 ms, the GIL released) no longer holds up the event loop, and the sends of different requests
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
    """``await future``, which runs on a thread; a cancellation meanwhile is raised once it has ended."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


class PolledFlags:
    """The launcher's ``broken`` flag (serving.run_folder.RunFlags) as every running request of a model
    polls it in :func:`watch`: read from its file at most once per ``seconds`` for all of them (256
    streams polled one open() each, 5,000 a second). Used from one event loop only."""

    def __init__(self, flags, seconds: float = CANCEL_POLL_SECONDS):
        self.flags, self.seconds = flags, seconds
        self.read_at, self.value = -float("inf"), None

    def broken(self) -> str | None:
        now = time.monotonic()
        if now - self.read_at >= self.seconds:
            self.value, self.read_at = self.flags.broken(), now
        return self.value


async def watch(task: asyncio.Task, request, flags, lingering: set) -> str | None:
    """Wait for ``task``, which serves ``request``, and for the cleanup it leaves (``lingering``).

    A client that leaves cancels the task (again each poll: Python 3.11's ``wait_for`` can swallow one
    cancellation). Returns None once all is over, so that the caller sends the final response; or, at
    once, the launcher's message when the server is about to be replaced (the task cancelled). The final
    response must come after the last ``is_cancelled()`` (docs/triton.md#T3), and after the cleanup, whose
    BLS requests must outlive their tasks (docs/triton.md#T4)."""
    global _watching
    _watching += 1
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=cancel_poll_seconds(_watching))
            if not task.done() and RETIRED.is_cancelled(request):
                task.cancel()
            if not task.done() and (broken := flags.broken()):
                task.cancel()
                return broken
    finally:
        _watching -= 1
    while lingering:
        await asyncio.wait(set(lingering))
    if RETIRED.held:  # the iterators this request's streams left (docs/triton.md#T18): let go of them now
        RETIRED.is_cancelled(request)
    return None


class BLS:
    """What the three clients share: ``pb``, the timeout, the thread pool for stream iteration and the
    request parameters that mark a request as ours (:class:`serving.auth.Keys`)."""

    def __init__(self, pb, timeout: float, pool, parameters: dict[str, str] | None = None, flags=None):
        self.pb, self.timeout, self.pool, self.parameters = pb, timeout, pool, dict(parameters or {})
        self.flags = flags  # serving.run_folder.RunFlags: a call to a model whose stub died ends at once

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
        loop = asyncio.get_running_loop()

        async def exchange():  # this frame keeps the request alive until its response is in
            if not decoupled:
                return await request.async_exec()
            responses = await request.async_exec(decoupled=True)
            try:
                return await loop.run_in_executor(self.pool, _final, responses)
            finally:
                RETIRED.retire(responses)  # held until the stub has let go of it: docs/triton.md#T18

        task, deadline = linger(exchange()), time.monotonic() + self.timeout
        while not task.done():  # left to run whatever happens here (the request must outlive its exchange)
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"{model} did not answer within {self.timeout:.0f} s")
            await asyncio.wait({task}, timeout=min(left, DEAD_POLL_SECONDS))
            # a stub that died mid-request never answers it; the launcher says so (serving.supervise)
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
    """A decoupled BLS response iterator, read on a thread. At most one ``next`` runs at a time: a read
    cut short (timeout, cancellation) is resumed by the following one, never started twice."""

    def __init__(self, bls: BLS, model: str, responses):
        self.bls, self.model, self.responses = bls, model, responses
        self.pending: asyncio.Future | None = None

    async def next(self, lost: Callable[[], bool] = lambda: False):
        """The next response, None at the end of the stream. StreamFailed as soon as ``lost()`` says the
        model has given the stream up (checked every LOST_POLL_SECONDS while waiting, less often when many
        streams wait: :func:`lost_poll_seconds`)."""
        if self.pending is None:
            self.pending = asyncio.get_running_loop().run_in_executor(self.bls.pool, next, self.responses, None)
        deadline = time.monotonic() + self.bls.timeout
        global _reading
        _reading += 1
        try:
            response = await self._wait(deadline, lost)
        finally:
            _reading -= 1
        self.pending = None
        return response

    async def _wait(self, deadline: float, lost: Callable[[], bool]):
        # asyncio.wait leaves the read be when it times out or is cancelled (no shield, no exception per poll)
        while not self.pending.done():
            await asyncio.wait({self.pending}, timeout=lost_poll_seconds(_reading))
            if self.pending.done():
                break
            if lost():
                raise StreamFailed(UNAVAILABLE + LOST)
            if time.monotonic() > deadline:
                # unavailable: the stream went astray in the server (Triton dropped it); a retry may work
                raise TimeoutError(f"{UNAVAILABLE}{self.model} sent nothing for {self.bls.timeout:.0f} s; retry")
        return self.pending.result()

    def close(self) -> None:
        """The stream is no longer read: its iterator is let go of once the stub has (docs/triton.md#T18)."""
        RETIRED.retire(self.responses, self.pending)


class BLSPrompts:
    """The prompt encoder over BLS. The default voice (no reference, no voice id, no reference text) is the
    checkpoint's silent prompt, the same for every request of the server's life: it is asked for once and
    kept (one BLS round trip per request fewer); every other voice is asked for each time (a voice id's
    prompt may change as the voice is registered again). A failed call is not kept."""

    def __init__(self, bls: BLS):
        self.bls = bls
        self.default: dict | None = None  # the default voice's prompt, once the encoder has answered

    async def encode(self, voice: Voice) -> dict:
        if voice.ref_audio is None and not voice.voice_id and not voice.ref_text:
            if self.default is None:
                prompt = await self._encode(voice)  # copied: kept for good, not tied to the response's memory
                self.default = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in prompt.items()}
            return self.default
        return await self._encode(voice)

    async def _encode(self, voice: Voice) -> dict:
        values = {"REF_TEXT": voice.ref_text, "VOICE_ID": voice.voice_id}
        if voice.ref_audio is not None:
            values |= {"REF_AUDIO": voice.ref_audio, "REF_SAMPLE_RATE": voice.ref_sample_rate}
        inputs = tensors(self.bls.pb, contract.PROMPT_INPUTS, values)
        out = await self.bls.call("prompt_encoder", inputs, [s.name for s in contract.VOICE_PROMPT_OUTPUTS])
        out["PROMPT_TEXT"] = contract.text_of(out["PROMPT_TEXT"])
        return out


# The prompt tensors of a stream without a voice prompt (Instruct's voice design).
NO_PROMPT = {
    "PROMPT_LATENTS": np.zeros((0, LATENT_DIM), np.float32),
    "SPEAKER": np.zeros(0, np.float32),
    "PROMPT_TEXT": "",
}


class BLSGenerator:
    """Generator streams; closing one before its last chunk marks it cancelled and waits for its end."""

    def __init__(
        self, bls: BLS, cancels: CancelBoard, model: str = "generator", slots: GeneratorSlots | None = None
    ):  # fmt: skip
        """``model``: the generator's name in Triton (a secret of the run: serving.auth.Keys.generator_model);
        ``slots``: the generator's slots, one taken before a stream is sent (serving.generator_slots)."""
        self.bls, self.cancels, self.model, self.slots = bls, cancels, model, slots

    async def stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        if self.slots is None:
            async with contextlib.aclosing(self._stream(segment)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        await self.slots.take()
        try:
            async with contextlib.aclosing(self._stream(segment)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.slots.give_back()

    async def _stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        pb, p = self.bls.pb, segment.params
        values = {**(segment.prompt or NO_PROMPT), "TEXT": segment.text, "LANGUAGE": segment.language, "SEED": p.seed}
        if segment.task:  # FireRedTTS3-Instruct
            values |= {"TASK": segment.task, "INSTRUCTION": segment.instruction}
        parameters = {**generator_parameters(p, segment.schedule), **self.bls.parameters}
        request = pb.InferenceRequest(
            model_name=self.model, inputs=tensors(pb, contract.GENERATOR_INPUTS, values), parameters=parameters,
            requested_output_names=[s.name for s in contract.GENERATOR_OUTPUTS], correlation_id=segment.stream_id,
            flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        )  # fmt: skip
        started = self.bls.submit(request, decoupled=True)
        try:
            responses = ResponseStream(self.bls, "generator", await self._started(segment.stream_id, started))
        except asyncio.CancelledError:  # the stream starts anyway: end it as soon as it has
            linger(self._cancel_once_started(segment.stream_id, started, request))
            raise
        ended = False
        try:
            while not ended:
                response = await responses.next(lambda: self.cancels.consume_lost(segment.stream_id))
                if response is None:
                    return  # the orchestrator reports a stream that ended without a last chunk
                self.bls.raise_for("generator", response)
                if not response.output_tensors():
                    continue
                chunk = read_chunk(lambda n, r=response: _output(pb, r, n))
                ended = chunk.last
                yield chunk
        finally:
            if not ended:  # shielded: cut short, it would drop the request before its stream ended
                await asyncio.shield(linger(self._cancel(segment.stream_id, responses, request)))
            else:
                responses.close()

    async def _started(self, stream_id: int, started: asyncio.Task):
        """The stream's response iterator, once the generator has answered it. StreamFailed (unavailable)
        when the generator lost the stream first, or nothing came within the timeout: Triton dropped the
        request (a failed reschedule, "must specify the START flag") and will never answer it, so its
        BLS call stops holding up this request's final response (:data:`LINGERING`); the task itself
        stays alive (engine.orchestrator keeps it), with the request whose tensors Triton might read."""
        deadline = time.monotonic() + self.bls.timeout
        while not started.done():
            await asyncio.wait({started}, timeout=LOST_POLL_SECONDS)  # a cancelled caller leaves ``started`` be
            if started.done():
                break
            lost = self.cancels.consume_lost(stream_id)
            if lost or time.monotonic() > deadline:
                unlinger(started)
                if not lost:  # should the generator ever step it, it ends it at once
                    self.cancels.mark(stream_id)
                late = f"the generator did not start the stream within {self.bls.timeout:.0f} s; retry"
                raise StreamFailed(UNAVAILABLE + (LOST if lost else late))
        return started.result()

    async def _cancel_once_started(self, stream_id: int, started: asyncio.Task, request) -> None:
        try:
            await self._cancel(stream_id, ResponseStream(self.bls, "generator", await started), request)
        except Exception as e:
            log.warning("stream %x: could not cancel it: %s", stream_id, e)

    async def _cancel(self, stream_id: int, responses: ResponseStream, request) -> None:
        """Ask the generator to end the stream (it does so at its next step) and wait for that.

        ``request`` is held until then: Triton reads its input tensors at every step of the stream
        (docs/triton.md#T4)."""
        self.cancels.mark(stream_id)
        try:
            while True:
                response = await responses.next(lambda: self.cancels.consume_lost(stream_id))
                if response is None or response.has_error():
                    break
                if response.output_tensors() and _output(self.bls.pb, response, "LAST").reshape(-1)[0]:
                    break
        except StreamFailed:  # the generator gave the stream up itself
            pass
        except TimeoutError as e:  # the mark stays: the generator consumes it if it ever steps again
            log.warning("stream %x: %s after it was cancelled", stream_id, e)
            return
        finally:
            responses.close()
        self.cancels.clear(stream_id)  # the stream is over; a mark it did not consume is obsolete


def _final(responses):
    """A decoupled model's one final response, read to the end of its stream (on a pool thread)."""
    got = [r for r in responses if r.has_error() or r.output_tensors()]
    if len(got) != 1:
        raise RuntimeError(f"expected one response, got {len(got)}")
    return got[0]


def _output(pb, response, name: str):
    t = pb.get_output_tensor_by_name(response, name)
    return None if t is None else t.as_numpy()
