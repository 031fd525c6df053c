"""The model's per-stream services, used in-process (offline synthesis) and behind Triton alike.

- :class:`GeneratorService`: streams keyed by stream id, each in a slot of one batched generator;
  :meth:`~GeneratorService.step` advances the given streams by one patch and returns the chunks due.
- :class:`VocoderService`: per-stream primed RedAE decoder state, started by a stream's first chunk and
  freed by its last one (or when it idles too long).

Both speak :class:`~engine.protocol.Chunk`, the one generator -> vocoder protocol. No Triton here.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.chunking import ChunkClock, ChunkSchedule
from engine.fireredtts3 import FireRedTTS3, PrimedDecoder
from engine.generator import InstructInput, Stream
from engine.models.redae import decode_together, joinable
from engine.params import DEFAULT_SCHEDULE, GenerationParams
from engine.prompt import VoicePrompt
from engine.protocol import CANCELLED, LATENT_DIM, LENGTH, STOP, Chunk, end_chunk
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

    Who holds a slot, who waits for KV-cache pages and who steps is :attr:`scheduler`
    (:class:`~engine.scheduler.Scheduler`, plain ints); this class holds the tensors: each stream's
    generation state and the latents of the chunk it is gathering.

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
    ):  # fmt: skip
        if slots < 1:
            raise ValueError("need at least one slot")
        self.model = model
        self.slots = slots
        self.gen = model.generator(slots, max_len, kv_pages=kv_pages, kv_memory_gb=kv_memory_gb, attention=attention)
        self.scheduler = Scheduler(slots, getattr(self.gen.cache, "blocks", None))
        self.live: dict[int, GeneratorStream] = {}
        self.clock = clock

    @property
    def active(self) -> int:
        return len(self.live)

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
        state = self.gen.new_stream(slot, tokens, prompt, params, reserve=False)
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
        state = self.gen.new_instruct_stream(slot, given, params, reserve=False)
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
        self.scheduler.admit(stream_id, state.positions_needed(), state.phase)
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
        stream still waiting for cache pages is not stepped (None).
        """
        plan = self.scheduler.schedule(stream_ids)
        out: dict[int, Chunk | None] = dict.fromkeys(plan.waiting)
        streams = [self.live[i] for i in plan.run]
        results = self.gen.step([s.state for s in streams]) if streams else []
        now = self.clock()
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
            elif s.state.phase is not self.scheduler.streams[s.stream_id].phase:
                self.scheduler.set_phase(s.stream_id, s.state.phase)
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


@dataclass
class VocoderStream:
    decoder: PrimedDecoder
    last_seen: float  # time.monotonic() of its latest chunk


class VocoderService:
    """Per-stream decoders keyed by stream id, driven by :class:`~engine.protocol.Chunk` messages.

    A stream starts with the first chunk that carries prompt latents (priming the decoder so that its
    audio equals offline decoding), and ends with its ``last`` chunk: a normal end flushes the iSTFT
    tail, a cancelled or failed one only frees the state. Priming (decoding the whole prompt) is done
    once per distinct prompt and kept in a small LRU: streams of a stored voice start from a copy.
    """

    def __init__(self, model: FireRedTTS3, idle_seconds: float = 60.0, primed_cache: int = 32, max_streams: int = 1024):
        self.model = model
        self.idle_seconds, self.max_streams = idle_seconds, max_streams
        self.streams: dict[int, VocoderStream] = {}
        self.primed: OrderedDict[bytes, PrimedDecoder] = OrderedDict()
        self.primed_cache = primed_cache
        self.primed_hits = 0
        self.batched_rows = 0  # chunks decoded in a batched forward with other streams

    def _primed(self, prompt_latents: np.ndarray) -> PrimedDecoder:
        lat = np.ascontiguousarray(prompt_latents, np.float32)
        key = hashlib.sha256(lat.tobytes() + str(lat.shape).encode()).digest()
        if key in self.primed:
            self.primed.move_to_end(key)
            self.primed_hits += 1
            return self.primed[key].clone()
        decoder = self.model.decoder_stream(torch.from_numpy(lat))
        if self.primed_cache > 0:
            self.primed[key] = decoder.clone()
            while len(self.primed) > self.primed_cache:
                self.primed.popitem(last=False)
        return decoder

    @property
    def active(self) -> int:
        return len(self.streams)

    def process(self, chunk: Chunk) -> np.ndarray:
        """One chunk -> float32 samples finished by it (all the rest with ``last``)."""
        out = self.process_many([chunk])[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def process_many(self, chunks: list[Chunk]) -> list[np.ndarray | Exception]:
        """Chunks of several streams, in arrival order (a stream may appear more than once).

        Returns, per chunk, float32 samples or the exception that failed that chunk alone (its stream's
        state is dropped then). Chunks of distinct streams past their priming transient with equal
        lengths are decoded in one batched forward.
        """
        results: list = [None] * len(chunks)
        seen: dict[int, int] = {}
        rounds: list[list[int]] = []  # round k holds the k-th chunk of each stream, so order is kept
        for i, c in enumerate(chunks):
            k = seen[c.stream_id] = seen.get(c.stream_id, -1) + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(i)
        for idx in rounds:
            self._round(chunks, idx, results)
        return results

    def _round(self, chunks: list[Chunk], idx: list[int], results: list) -> None:
        now = time.monotonic()
        parts: dict[int, list[np.ndarray]] = {}
        decode = []
        for i in idx:
            c = chunks[i]
            try:
                if c.last and c.finish_reason not in (STOP, LENGTH):  # cancelled or failed: free only
                    self.streams.pop(c.stream_id, None)
                    results[i] = np.zeros(0, np.float32)
                    continue
                if c.plan:
                    raise ValueError("a plan chunk (text) is not for the vocoder")
                # a stream's first audio chunk (seq 0) carries its prompt latents, maybe none (Instruct)
                if len(c.prompt_latents) or (c.seq == 0 and c.stream_id not in self.streams):
                    if c.stream_id in self.streams:
                        raise ValueError("the vocoder stream was started twice")
                    if len(self.streams) >= self.max_streams:
                        raise RuntimeError(f"the vocoder holds its maximum of {self.max_streams} streams")
                    self.streams[c.stream_id] = VocoderStream(self._primed(c.prompt_latents), now)
                stream = self.streams.get(c.stream_id)
                if stream is None:
                    raise ValueError(
                        "the vocoder stream is unknown (its first chunk never came, "
                        "or it ended, or it was reclaimed after idling)"
                    )
                stream.last_seen = now
                parts[i] = []
                if len(c.latents):
                    decode.append(i)
            except Exception as e:
                self.streams.pop(c.stream_id, None)
                results[i] = e
        groups: dict[int, list[int]] = {}
        for i in decode:
            groups.setdefault(len(chunks[i].latents), []).append(i)
        for group in groups.values():
            self._decode(chunks, group, parts, results)
        for i in parts:
            c = chunks[i]
            if results[i] is not None:
                self.streams.pop(c.stream_id, None)
                continue
            if c.last:
                parts[i].append(self.streams.pop(c.stream_id).decoder.finish())
            results[i] = np.concatenate(parts[i]) if parts[i] else np.zeros(0, np.float32)

    def _decode(self, chunks: list[Chunk], group: list[int], parts: dict, results: list) -> None:
        decoders = [self.streams[chunks[i].stream_id].decoder for i in group]
        if joinable([d.stream for d in decoders]) and all(d.to_skip == 0 for d in decoders):
            lat = np.stack([np.ascontiguousarray(chunks[i].latents, np.float32) for i in group])
            try:
                audio = decode_together(
                    [d.stream for d in decoders],
                    torch.from_numpy(lat).to(self.model.device, self.model.dtypes["decoder"], non_blocking=True),
                )
            except Exception as e:  # nothing was changed: fail these chunks only
                for i in group:
                    results[i] = e
                return
            audio = audio.float().cpu().numpy()
            for row, i in enumerate(group):
                parts[i].append(audio[row])
            self.batched_rows += len(group)
            return
        for i, d in zip(group, decoders, strict=True):
            try:
                parts[i].append(d.decode(torch.from_numpy(np.ascontiguousarray(chunks[i].latents, np.float32))))
            except Exception as e:
                results[i] = e

    def reap(self) -> list[int]:
        """Drop streams idle longer than ``idle_seconds``; returns their ids."""
        cutoff = time.monotonic() - self.idle_seconds
        dead = [i for i, v in self.streams.items() if v.last_seen < cutoff]
        for i in dead:
            del self.streams[i]
        return dead
