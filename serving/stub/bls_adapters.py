"""The orchestrator's prompt encoder and generator streams as BLS calls to the Triton models (``tts``,
``ensemble_generator``; the vocoder's is :class:`serving.stub.vocoder_batch.BLSVocoder`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from engine.chunking import PATCH_SECONDS
from engine.config import PATCH_SIZE
from engine.lifetime import linger, unlinger
from engine.orchestrator import Segment, Yielded
from engine.protocol import Chunk
from serving import contract
from serving.flow.admission import Admission
from serving.flow.pacing import PACING
from serving.flow.receipts import Receipts
from serving.intake.requests import Voice
from serving.stub.bls import BLS, first_response
from serving.stub.chunk_pipe import PARAMETER as PIPE
from serving.stub.chunk_pipe import unpack
from serving.stub.pipe_reader import NO_PROMPT, Inbox, PipeReader
from serving.stub.triton_io import bls_error, outputs, tensors

log = logging.getLogger("tts")
LATENT_SECONDS = PATCH_SECONDS / PATCH_SIZE  # speech in one latent row of a chunk


class BLSPrompts:
    """The prompt encoder over BLS. The default voice (no reference, voice id or reference text) is the same
    for the server's life: asked for once and kept (a failed call is not); every other voice each time (a
    voice id's prompt changes as the voice is registered again)."""

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


class BLSGenerator:
    """Generator streams, their chunks on this process's pipe (serving.stub.chunk_pipe); closing one before
    its last chunk marks it cancelled and waits for its end."""

    def __init__(self, bls: BLS, model: str, slots: Admission, receipts: Receipts | None, pipe_ids: Callable[[], int]):
        """``model``: the generator's secret name; ``slots``: one taken before a stream is sent; ``receipts``:
        this sender's read receipts (one entry per pipe); ``pipe_ids``: new ids for this process's pipes."""
        self.bls, self.channel, self.model, self.slots = bls, bls.channel, model, slots
        self.pipe = PipeReader(bls, bls.channel, model, receipts, pipe_ids)

    async def stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        """The segment's chunks. A read-ahead segment takes only a free slot no start waits for (else
        :class:`~engine.orchestrator.Yielded`). A paced request's pacer (PACING, set by tts) knows the stream
        from its start to its end."""
        if not segment.ahead:
            await self.slots.take_slot()
        elif not self.slots.take_ahead():  # a read-ahead segment never waits, nor takes a waiting start's slot
            raise Yielded("no free generator slot")
        pacer = PACING.get()
        if pacer is not None:
            pacer.open(segment.stream_id)
        try:
            async with contextlib.aclosing(self._stream(segment)) as chunks:
                async for chunk in chunks:
                    if pacer is not None:
                        pacer.on_made(len(chunk.latents) * LATENT_SECONDS, time.monotonic())
                    yield chunk
        finally:
            if pacer is not None:
                pacer.close(segment.stream_id)
            self.slots.give_slot()

    def _request(self, segment: Segment, pipe_id: int):
        pb, (seed, settings) = self.bls.pb, contract.encode_settings(segment.params, segment.schedule)
        values = {**(segment.prompt or NO_PROMPT), "TEXT": segment.text, "LANGUAGE": segment.language, "SEED": seed}
        if segment.task:  # FireRedTTS3-Instruct
            values |= {"TASK": segment.task, "INSTRUCTION": segment.instruction}
        return pb.InferenceRequest(
            model_name=self.model, inputs=tensors(pb, contract.GENERATOR_INPUTS, values),
            parameters={**settings, **self.bls.parameters, PIPE: f"{pipe_id:x}"},
            requested_output_names=[s.name for s in contract.PIPE_OUTPUTS], correlation_id=segment.stream_id,
            flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        )  # fmt: skip

    async def _stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        """The stream's chunks from the pipe; its own request gets one final response (None in its inbox)
        once the generator has admitted it (docs/triton.md#T28), or a chunk when it never started."""
        stream_id = segment.stream_id
        pipe_id, inbox = await self.pipe.join(stream_id)
        own = linger(self._own_end(self._request(segment, pipe_id), inbox))
        ended = False
        try:
            while not ended:
                try:
                    chunk = await inbox.get()
                except Exception:  # lost by the generator, dropped by Triton (T14), or refused: nothing to cancel
                    ended = True  # nothing is left to cancel
                    if not own.done():
                        unlinger(own)  # the request stays alive (the task holds it) until answered, if ever
                        self.channel.mark("cancel", stream_id)  # should the generator ever step it, it ends it
                    raise
                if chunk is None:  # the stream's own final: it started, its chunks come on the pipe
                    continue
                ended = chunk.last
                yield chunk
        finally:
            if ended:
                self.pipe.leave(stream_id)
            else:  # shielded: cut short, it would drop the request before its stream ended; it leaves the
                # pipe at its end, even when this frame is cancelled again meanwhile
                await asyncio.shield(linger(self._cancel(stream_id, inbox)))

    async def _own_end(self, request, inbox: Inbox) -> None:
        """Send a stream's request and put its one final response in ``inbox``: None (admitted: its chunks come
        on the pipe), a chunk (it never started) or the error. ``request`` is held until then (T4)."""
        item = None  # admitted, or no response at all
        try:
            response = await first_response(request)
            if response is not None and (response.has_error() or response.output_tensors()):
                item = bls_error(self.bls.pb, "generator", response) or unpack(outputs(self.bls.pb, response))[0]
        except Exception as e:  # noqa: BLE001 (the stream fails with it)
            item = e
        inbox.put(item)

    async def _cancel(self, stream_id: int, inbox: Inbox) -> None:
        """Ask the generator to end a stream (at its next step), wait for its last chunk, leave the pipe."""
        self.channel.mark("cancel", stream_id)
        try:
            while True:
                item = await inbox.get()
                if item is not None and item.last:  # its last chunk (or its refusal): the generator is done with it
                    break
        except TimeoutError as e:  # the mark stays: the generator consumes it if it ever steps again
            log.warning("stream %x: %s after it was cancelled", stream_id, e)
            return
        except Exception:  # noqa: BLE001 (it failed: the generator gave it up)
            pass
        finally:
            self.pipe.leave(stream_id)
        self.channel.unmark("cancel", stream_id)
