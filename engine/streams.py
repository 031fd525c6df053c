"""The generator's per-stream service, used in-process (offline synthesis) and behind Triton alike:
:class:`GeneratorService` keeps streams keyed by stream id, each in a slot of one batched generator;
:meth:`~GeneratorService.step` advances the given streams by one patch and returns the chunks due, as
:class:`~engine.protocol.Chunk`, the one generator -> vocoder protocol. Its counterpart on the other
side of that protocol is :class:`engine.vocoder_service.VocoderService`. No Triton here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.chunking import ChunkClock, ChunkSchedule
from engine.fireredtts3 import FireRedTTS3
from engine.generator import InstructInput, Stream
from engine.generator_state import Phase
from engine.params import DEFAULT_SCHEDULE, GenerationParams
from engine.prompt import VoicePrompt
from engine.protocol import CANCELLED, LATENT_DIM, Chunk, end_chunk
from engine.scheduler import Scheduler


@dataclass
class GeneratorStream:
    """One request's stream: its generation state (which names its KV-cache slot) and its chunking."""

    stream_id: int
    state: Stream
    prompt_latents: np.ndarray  # (4P, 64): sent with the first chunk, to prime the vocoder ((0, 64): none)
    clock: ChunkClock  # when the gathered patches become a chunk
    pending: list[torch.Tensor] = field(default_factory=list)
    chunks_sent: int = 0


class GeneratorService:
    """Streams keyed by stream id, stepped together by one batched :class:`~engine.generator.Generator`.

    Who holds a slot, who waits for KV-cache pages, who steps and which pages each step writes is
    :attr:`scheduler` (:class:`~engine.scheduler.Scheduler`, plain ints), which owns the page
    bookkeeping (:class:`~engine.block_manager.BlockManager`, built here to the generator's cache);
    this class holds the tensors: each stream's generation state and the latents of the chunk it is
    gathering.

    No free slot: :meth:`admit` raises RuntimeError (the caller keeps the stream queued, as Triton's
    sequence batcher does). A free slot but not enough free KV-cache pages: the stream is admitted
    *waiting*; :meth:`step` starts it (in arrival order) as soon as ended streams give their pages back,
    and returns no chunk for it until then. A stream that could never fit is refused with ValueError.

    ``clock``: seconds of a monotonic clock, read once per step for the chunk decisions
    (:mod:`engine.chunking`); tests pass their own.
    """

    def __init__(
        self, model: FireRedTTS3, slots: int, max_len: int, kv_pages: int | None = None,
        kv_memory_gb: float | None = None, attention: str = "auto", clock: Callable[[], float] = time.monotonic,
        batch_invariant: bool = False,
    ):  # fmt: skip
        if slots < 1:
            raise ValueError("need at least one slot")
        self.model = model
        self.slots = slots
        self.gen = model.generator(slots, max_len, kv_pages=kv_pages, kv_memory_gb=kv_memory_gb, attention=attention,
                                   batch_invariant=batch_invariant)  # fmt: skip
        cache = self.gen.cache
        self.scheduler = Scheduler(slots, BlockManager(cache.slots, cache.max_len, cache.num_pages, cache.page_size))
        self.live: dict[int, GeneratorStream] = {}
        self.clock = clock

    @property
    def active(self) -> int:
        return len(self.live)

    def phases(self) -> dict[Phase, int]:
        """Live streams per phase (those waiting for pages included), read from the streams themselves."""
        counts = dict.fromkeys(Phase, 0)
        for s in self.live.values():
            counts[s.state.phase] += 1
        return counts

    @property
    def free(self) -> deque[int]:
        """Free slots, the next one first."""
        return self.scheduler.free

    @property
    def waiting(self) -> deque[int]:
        """Live streams waiting for KV-cache pages, oldest first."""
        return self.scheduler.queue

    def admit(
        self, stream_id: int, tokens: list[int], prompt: VoicePrompt, params: GenerationParams,
        schedule: ChunkSchedule = DEFAULT_SCHEDULE,
    ) -> None:  # fmt: skip
        """Give ``stream_id`` a slot and a stream (waiting for cache pages if the pool is short now).
        Raises ValueError for bad input or a stream the pool can never hold (nothing is kept then)."""
        slot = self.scheduler.next_slot(stream_id)
        state = self.gen.new_stream(slot, tokens, prompt, params)
        self._admitted(stream_id, state, prompt.latents.float().numpy(), schedule)

    def admit_instruct(
        self, stream_id: int, given: InstructInput, params: GenerationParams,
        schedule: ChunkSchedule = DEFAULT_SCHEDULE,
    ) -> None:  # fmt: skip
        """As :meth:`admit`, for an Instruct stream (:meth:`~engine.fireredtts3.FireRedTTS3.instruct_input`).

        The vocoder is primed with the cloning prompt's latents (RedAE's, unscaled), with nothing for
        design and edits. A stream with a text phase yields its plan chunk (``Chunk.text``) in the step
        that ends the plan, before its first audio chunk.
        """
        slot = self.scheduler.next_slot(stream_id)
        state = self.gen.new_instruct_stream(slot, given, params)
        out = given.latents_out
        latents = np.zeros((0, LATENT_DIM), np.float32) if out is None else out.float().cpu().numpy()
        self._admitted(stream_id, state, latents, schedule)

    def admit_task(
        self, stream_id: int, task: str, params: GenerationParams, instruction: str = "", text: str = "",
        latents: torch.Tensor | None = None, prompt_text: str = "", schedule: ChunkSchedule = DEFAULT_SCHEDULE,
    ) -> None:  # fmt: skip
        """:meth:`admit_instruct` from a request's fields: an Instruct ``task`` (engine.instruct.Task's
        values), its instruction, the text to say, the (4N, 64) RedAE latents of the cloning prompt or the
        recording to edit, and the prompt's transcript (see :meth:`FireRedTTS3.instruct_input`)."""
        given = self.model.instruct_input(task, instruction, text, latents, prompt_text)
        self.admit_instruct(stream_id, given, params, schedule)

    def _admitted(self, stream_id: int, state: Stream, latents: np.ndarray, schedule: ChunkSchedule) -> None:
        self.scheduler.admit(stream_id, state.positions_needed(), state.prefix_length())
        self.live[stream_id] = GeneratorStream(stream_id, state, latents, ChunkClock(schedule, self.clock()))

    def drop(self, stream_id: int) -> bool:
        """Free the stream's slot and pages (finished, cancelled or failed). Returns False if it had none."""
        self.live.pop(stream_id, None)
        return self.scheduler.finish(stream_id)

    def cancel(self, stream_id: int) -> Chunk:
        """End a stream now: its slot is freed and this is its last chunk."""
        self.drop(stream_id)
        return end_chunk(stream_id, CANCELLED)

    def step(self, stream_ids: list[int]) -> dict[int, Chunk | None]:
        """One generator step for the given live streams -> per stream the chunk that is due, or None.

        A chunk is due when the stream's :class:`~engine.chunking.ChunkClock` says so and when the
        stream ends; a stream's first chunk carries its prompt latents. Finished streams are freed. A
        stream still waiting for cache pages is not stepped (None). A live stream not in ``stream_ids``
        (paused) keeps its slot and pages, and its chunk clock does not count this step as its own.
        """
        plan = self.scheduler.schedule(stream_ids)
        out: dict[int, Chunk | None] = dict.fromkeys(plan.waiting)
        streams = [self.live[i] for i in plan.run]
        results = self.gen.step([s.state for s in streams], plan.pages) if streams else []
        now = self.clock()
        if len(stream_ids) < len(self.live):  # streams not asked (paused) rest: their clocks skip this step
            asked = set(stream_ids)
            for s in self.live.values():
                if s.stream_id not in asked:
                    s.clock.rest(now)
        for s, r in zip(streams, results, strict=True):
            if r.latents is not None:
                s.pending.append(r.latents)
            out[s.stream_id] = None
            due = r.finished or s.clock.due(len(s.pending), now)
            if r.text_ids is not None:
                text = self.model.models.tokenizer.decode(r.text_ids)
                out[s.stream_id] = Chunk(s.stream_id, _EMPTY, _EMPTY, text=text)
            elif due:
                out[s.stream_id] = self._chunk(s, r.finished, r.reason)
            if r.finished:
                self.drop(s.stream_id)
        return out

    def _chunk(self, s: GeneratorStream, last: bool, reason: str) -> Chunk:
        empty = _EMPTY
        latents = torch.cat(s.pending).float().cpu().numpy() if s.pending else empty
        prompt = s.prompt_latents if s.chunks_sent == 0 else empty
        seq = s.chunks_sent
        s.pending, s.chunks_sent = [], s.chunks_sent + 1
        return Chunk(s.stream_id, latents, prompt, last, reason if last else "", seq=seq)


_EMPTY = np.zeros((0, LATENT_DIM), np.float32)
_EMPTY.flags.writeable = False
