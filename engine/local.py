"""In-process implementations of the orchestrator's interfaces (offline synthesis, tests, benchmarks).

They run the same :class:`~engine.streams.GeneratorService` and :class:`~engine.vocoder_service.VocoderService`
as the ``generator`` and ``vocoder`` Triton models, so offline audio equals streamed audio by
construction; the tests compare both against an independent whole-utterance decode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from engine.fireredtts3 import FireRedTTS3
from engine.generator import Stream
from engine.generator_state import base_prefix, positions_needed
from engine.orchestrator import Orchestrator, Segment, Yielded
from engine.prompt import VoicePrompt
from engine.protocol import Chunk, end_chunk, failure_reason
from engine.streams import GeneratorService
from engine.vocoder_service import VocoderService


class LocalPrompts:
    """Voice -> prompt: a :class:`VoicePrompt` as is, ``(audio, sample_rate, text)`` encoded, None silent."""

    def __init__(self, model: FireRedTTS3):
        self.model = model

    async def encode(self, voice) -> VoicePrompt:
        if voice is None:
            return self.model.encode_prompt(None)
        if isinstance(voice, VoicePrompt):
            return voice
        audio, sample_rate, text = voice
        return self.model.encode_prompt(audio, sample_rate, text)


class LocalGenerator:
    """Generator streams stepped one at a time in this process (a slot each, up to ``slots`` at once).
    ``clock``: the service's (:class:`~engine.streams.GeneratorService`), which times the chunks.

    Each stream is stepped alone (a batch of one), so a segment read ahead (the orchestrator's read-ahead)
    makes the same numbers as one run after the other, bit for bit. Nothing waits for a slot here (a stream
    that finds none fails, as before): a read-ahead segment starts only on a free slot of a service that
    holds it (:class:`~engine.orchestrator.Yielded` otherwise), and no start is ever left waiting."""

    def __init__(
        self, model: FireRedTTS3, slots: int = 1, max_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.model = model
        self.slots = slots
        self.max_len = max_len
        self.clock = clock
        self.service: GeneratorService | None = None
        # called with (segment, its generation state) when a stream is admitted: lets offline callers
        # (engine.synthesize.instruct_run) read what it was given and what it wrote
        self.on_admit: Callable[[Segment, Stream], None] | None = None
        self.on_chunk: Callable[[Chunk], None] | None = None  # and with every chunk it yields

    def _service(self, need: int) -> GeneratorService:
        """The service; without a fixed ``max_len`` it is (re)built, when idle, long enough for ``need``."""
        svc = self.service
        if svc is None or (not self.max_len and svc.active == 0 and svc.gen.cache.max_len < need):
            self.service = svc = GeneratorService(self.model, self.slots, self.max_len or need, clock=self.clock)
        return svc

    def free_slots(self) -> int:
        return self.slots if self.service is None else len(self.service.free)

    def starts_waiting(self) -> int:
        return 0

    def _fits_now(self, need: int) -> bool:
        """Would a stream needing ``need`` cache positions be admitted now without failing another's?"""
        svc = self.service
        if svc is None or svc.active == 0:
            return True
        return bool(svc.free) and (bool(self.max_len) or svc.gen.cache.max_len >= need)

    async def stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        prompt: VoicePrompt | None = segment.prompt
        try:
            if segment.task:
                given = self.model.instruct_input(
                    segment.task, segment.instruction, segment.text, None if prompt is None else prompt.latents,
                    "" if prompt is None else prompt.text,
                )  # fmt: skip
                need = positions_needed(len(given.tokens), given.sampling is not None, segment.params.max_patches)
                if segment.ahead and not self._fits_now(need):
                    raise Yielded("no free slot that holds it now")
                service = self._service(need)
                service.admit_instruct(segment.stream_id, given, segment.params, segment.schedule)
            else:
                tokens = self.model.tokens(segment.text, segment.language, prompt)
                need = positions_needed(base_prefix(len(tokens), prompt.num_patches), False, segment.params.max_patches)
                if segment.ahead and not self._fits_now(need):
                    raise Yielded("no free slot that holds it now")
                service = self._service(need)
                service.admit(segment.stream_id, tokens, prompt, segment.params, segment.schedule)
            if self.on_admit is not None:
                self.on_admit(segment, service.live[segment.stream_id].state)
        except Yielded:
            raise
        except Exception as e:  # reported the way the generator model reports it
            yield end_chunk(segment.stream_id, failure_reason(e))
            return
        try:
            while True:
                await asyncio.sleep(0)  # a step each, in turn with this loop's other streams (and read-ahead)
                chunk = service.step([segment.stream_id])[segment.stream_id]
                if chunk is not None:
                    if self.on_chunk is not None:
                        self.on_chunk(chunk)
                    yield chunk
                    if chunk.last:
                        return
        finally:
            service.drop(segment.stream_id)  # closed early: the slot is freed at once


class LocalVocoder:
    def __init__(self, model: FireRedTTS3, primed_cache: int = 0):
        self.service = VocoderService(model, primed_cache=primed_cache)

    async def decode(self, chunk: Chunk) -> np.ndarray:
        return self.service.process(chunk)


def local_orchestrator(
    model: FireRedTTS3, slots: int = 1, max_len: int | None = None, clock: Callable[[], float] = time.monotonic
) -> Orchestrator:
    """The whole pipeline in this process; ``clock`` times its chunks (engine.chunking)."""
    generator = LocalGenerator(model, slots, max_len, clock)  # its own slots' owner
    return Orchestrator(LocalPrompts(model), generator, LocalVocoder(model),
                        lambda text: len(model.models.tokenizer.encode(text)), clock=clock, slots=generator)  # fmt: skip
