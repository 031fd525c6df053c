"""The reading end of a generator pipe in ``tts`` or ``ensemble_generator`` (rotated: T25): docs/architecture.md,
"The generator pipe"."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from engine.lifetime import linger
from engine.protocol import LATENT_DIM, UNAVAILABLE, Chunk, StreamFailed
from serving import contract
from serving.flow.receipts import PARAMETER as RECEIPT
from serving.flow.receipts import Receipts
from serving.flow.side_channel import SideChannel
from serving.stub.bls import BLS, LOST, RETIRED
from serving.stub.chunk_pipe import OPEN, PARAMETER, unpack
from serving.stub.triton_io import bls_error, outputs, tensors

log = logging.getLogger("tts")
CLOSE_SECONDS = 5.0  # how long an unloading reader waits for the generator to end its pipe
WATCH_SECONDS = 0.25  # how often the streams waiting on a pipe are looked at (lost, or waiting too long)
ROTATE_BYTES = 32 << 20  # tensor bytes a pipe carries before new streams go on a new one (T25)
ROTATE_RESPONSES = 500  # responses a pipe carries before new streams go on a new one (T25: 7-20 KB each)
MAX_DRAINING = 4  # rotated pipes that may still carry streams at once
# The prompt tensors of a stream without a voice prompt (Instruct's voice design; a pipe's opening request).
NO_PROMPT = {"PROMPT_LATENTS": np.zeros((0, LATENT_DIM), np.float32), "SPEAKER": np.zeros(0, np.float32),
             "PROMPT_TEXT": ""}  # fmt: skip


class Inbox:
    """What a stream of a pipe receives, in order: chunks, then an exception if it failed (its pipe ended,
    the generator lost it, nothing came for too long: :meth:`PipeReader._watch`). Used on the event loop."""

    __slots__ = ("items", "since", "waiter")

    def __init__(self):
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.since = 0.0  # when the wait in progress began (monotonic)

    def put(self, item: Chunk | BaseException | None) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self):
        """The next item; an exception is raised."""
        if not self.items:
            self.waiter, self.since = asyncio.get_running_loop().create_future(), time.monotonic()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class PipeReader:
    """This process's pipe to the generator ``model``: :meth:`join` gives a stream's pipe id and inbox
    (opening the pipe first if none is open), :meth:`leave` forgets the stream."""

    def __init__(self, bls: BLS, channel: SideChannel, model: str, receipts: Receipts,
                 new_id: Callable[[], int]):  # fmt: skip
        self.bls, self.channel, self.model, self.receipts, self.new_id = bls, channel, model, receipts, new_id
        self.pipe_id = 0  # the open pipe (0: none)
        self.opening: asyncio.Task | None = None
        self.inboxes: dict[int, tuple[int, Inbox]] = {}  # stream -> (its pipe, its inbox)
        self.riding: dict[int, set[int]] = {}  # pipe -> its streams whose last chunk it has not carried yet
        self.carried: dict[int, list[int]] = {}  # pipe -> [tensor bytes, responses] read on it so far (its
        # reading thread adds, the event loop reads)
        self.draining: set[int] = set()  # rotated pipes whose streams have not all left
        self.watcher: asyncio.TimerHandle | None = None  # the next look at the streams (a timer, not a task:
        # nothing is left pending when the loop stops)
        self.readings: dict[int, threading.Thread] = {}  # each pipe's reading thread, until it ended

    async def join(self, stream_id: int) -> tuple[int, Inbox]:
        if self.watcher is None:
            self.watcher = asyncio.get_running_loop().call_later(WATCH_SECONDS, self._watch)
        carried = self.carried.get(self.pipe_id, (0, 0))  # past either bound, new streams go on a new pipe (T25)
        if (carried[0] >= ROTATE_BYTES or carried[1] >= ROTATE_RESPONSES) and len(self.draining) < MAX_DRAINING:
            self._rotate()
        if not self.pipe_id:
            if self.opening is None or self.opening.done():
                self.opening = asyncio.ensure_future(self._open())
            await asyncio.shield(self.opening)  # StreamFailed/TimeoutError if it could not be opened
        inbox = Inbox()
        self.inboxes[stream_id] = (self.pipe_id, inbox)
        self.riding.setdefault(self.pipe_id, set()).add(stream_id)
        return self.pipe_id, inbox

    def leave(self, stream_id: int) -> None:
        entry = self.inboxes.pop(stream_id, None)
        if entry is not None:
            self._alight(entry[0], stream_id)

    def _alight(self, pipe_id: int, stream_id: int) -> None:
        """The pipe carries nothing more for the stream (its last chunk came, or it left)."""
        riding = self.riding.get(pipe_id, set())
        if stream_id not in riding:
            return
        riding.discard(stream_id)
        if not riding:
            del self.riding[pipe_id]
            if pipe_id in self.draining:  # a rotated pipe's last stream is off it: it is ended
                self._finish(pipe_id)

    def _rotate(self) -> None:
        """New streams go on a new pipe; the open one is ended once its own streams have left."""
        old, self.pipe_id = self.pipe_id, 0
        self.draining.add(old)
        log.info("pipe %x carried %d bytes in %d responses: new streams go on a new pipe",
                 old, *self.carried.get(old, (0, 0)))  # fmt: skip
        if not self.riding.get(old):
            self._finish(old)

    def _finish(self, pipe_id: int) -> None:
        self.draining.discard(pipe_id)
        self.channel.mark("cancel", pipe_id)  # the generator ends it; its reading thread then lets go (_ended)

    def close(self, wait: float = CLOSE_SECONDS) -> None:
        """At the model's unload: ask the generator to end its pipes and wait (at most ``wait`` s) for their
        final responses (one that came after the reader was gone crashed tritonserver)."""
        for pipe_id in {self.pipe_id, *self.draining} - {0}:
            self.channel.mark("cancel", pipe_id)
        self.pipe_id = 0
        self.draining.clear()
        deadline = time.monotonic() + wait
        for thread in list(self.readings.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("the generator did not end this process's pipe %s within %.0f s", thread.name, wait)

    async def _open(self) -> None:
        pb, pipe_id = self.bls.pb, self.new_id()
        receipt = self.receipts.open(pipe_id)  # the generator sends each response once the one before was read
        if receipt is None:  # never unpaced (T23)
            raise StreamFailed(f"{UNAVAILABLE}all {self.receipts.capacity} read-receipt entries are in use "
                               "(docs/triton.md#T23): no new pipe to the generator; retry")  # fmt: skip
        request = pb.InferenceRequest(
            model_name=self.model, inputs=tensors(pb, contract.GENERATOR_INPUTS, {**NO_PROMPT, "TEXT": ""}),
            parameters={**self.bls.parameters, PARAMETER: OPEN, RECEIPT: receipt.parameter},
            requested_output_names=[s.name for s in contract.PIPE_OUTPUTS], correlation_id=pipe_id,
            flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        )  # fmt: skip

        async def exchange():  # this frame keeps the request alive until it is sent
            return await request.async_exec(decoupled=True)

        # a task that runs to its end whatever happens here: a request cut short is freed while Triton reads it (T4)
        started = linger(exchange())
        try:
            await asyncio.wait({started}, timeout=self.bls.timeout)
            if not started.done():  # should the generator ever open it, it ends it at once
                self.channel.mark("cancel", pipe_id)
                raise StreamFailed(
                    f"{UNAVAILABLE}the generator did not open a pipe within {self.bls.timeout:.0f} s; retry"
                )
            responses = started.result()
        except BaseException:
            receipt.close()
            raise
        loop = asyncio.get_running_loop()
        self.carried[pipe_id] = [0, 0]
        thread = self.readings[pipe_id] = threading.Thread(
            target=self._read, args=(loop, pipe_id, request, responses, receipt), name=f"pipe-{pipe_id:x}", daemon=True
        )  # fmt: skip
        thread.start()
        self.pipe_id = pipe_id
        log.info("opened a pipe to the generator: %x", pipe_id)

    def _read(self, loop, pipe_id: int, request, responses, receipt) -> None:
        """The pipe's reading thread: each response counted on its receipt the moment it is read, its
        chunks handed to the event loop; at the end, why it ended. ``request`` stays referenced until then."""
        why = "the generator ended it"
        carried = self.carried[pipe_id]
        try:
            for response in responses:
                receipt.read()
                if (error := bls_error(self.bls.pb, "generator", response)) is not None:
                    why = str(error)
                    break
                carried[1] += 1
                if response.output_tensors():
                    chunks = unpack(outputs(self.bls.pb, response))
                    carried[0] += sum(c.latents.nbytes + c.prompt_latents.nbytes for c in chunks)
                    loop.call_soon_threadsafe(self._deliver, chunks)
        except Exception as e:  # noqa: BLE001 (any failure ends the pipe; its streams are told)
            why = f"reading it failed: {e}"
        finally:
            receipt.close()
        del request
        loop.call_soon_threadsafe(self._ended, pipe_id, responses, why)

    def _watch(self) -> None:
        """Every WATCH_SECONDS, for all streams at once: lost marks, and waits past the BLS timeout (T14)."""
        try:
            if self.inboxes:
                lost, now = self.channel.poll()["lost"], time.monotonic()
                for stream_id, (_, inbox) in list(self.inboxes.items()):
                    if stream_id in lost and self.channel.take("lost", stream_id):
                        inbox.put(StreamFailed(UNAVAILABLE + LOST))
                    elif inbox.waiter is not None and now - inbox.since > self.bls.timeout:
                        inbox.put(
                            TimeoutError(f"{UNAVAILABLE}generator sent nothing for {self.bls.timeout:.0f} s; retry")
                        )
        except Exception:  # never let the watch die: every stream would wait forever
            log.exception("watching the pipe's streams failed")
        finally:
            self.watcher = asyncio.get_running_loop().call_later(WATCH_SECONDS, self._watch)

    def _deliver(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            entry = self.inboxes.get(chunk.stream_id)
            if entry is not None:  # else: a stream nobody reads any more
                entry[1].put(chunk)
                if chunk.last:
                    self._alight(entry[0], chunk.stream_id)

    def _ended(self, pipe_id: int, responses, why: str) -> None:
        RETIRED.retire(responses)  # held until the stub has let go of it: docs/triton.md#T18
        self.readings.pop(pipe_id, None)
        self.carried.pop(pipe_id, None)
        self.draining.discard(pipe_id)
        riding = self.riding.pop(pipe_id, set())  # the streams it had not carried to their end
        lost = [(i, inbox) for i, (p, inbox) in self.inboxes.items() if p == pipe_id and i in riding]
        if self.pipe_id == pipe_id:
            self.pipe_id = 0
        elif not lost:
            log.info("pipe %x ended (%s)", pipe_id, why)  # rotated or closed, its streams over
            return
        log.warning("the pipe to the generator ended (%s): %d streams on it fail", why, len(lost))
        for _, inbox in lost:
            inbox.put(StreamFailed(f"{UNAVAILABLE}the generator's pipe ended ({why}); retry"))
