"""Server-side stream bookkeeping, independent of Triton (the ``model.py`` files are thin adapters).

- :class:`GeneratorService`: streams keyed by correlation id, each in a slot of one batched generator;
  :meth:`step` advances all given streams by one patch and returns the chunks that are due.
- :class:`VocoderService`: per-stream primed RedAE decoder state, reclaimed on END, cancel or idle.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.generator import GenerationParams, Stream
from engine.models.redae import decode_together, joinable
from engine.pipeline import FireRedTTS3, PrimedDecoder
from engine.prompt import VoicePrompt
from engine.segments import chunk_sizes
from engine.slots import Handle, SlotTable


@dataclass
class _Live:
    handle: Handle
    stream: Stream
    sizes: object  # iterator of chunk sizes
    want: int
    pending: list = field(default_factory=list)


@dataclass
class Emission:
    latents: np.ndarray | None  # (L, 64) float32 chunk, or None when nothing is due this step
    finished: bool
    reason: str = ""


class GeneratorService:
    def __init__(self, tts: FireRedTTS3, slots: int, max_len: int):
        self.tts = tts
        self.table = SlotTable(slots)
        self.gen = tts.generator(slots, max_len)
        self.live: dict[int | str, _Live] = {}

    @property
    def active(self) -> int:
        return len(self.table)

    def admit(
        self,
        owner,
        tokens: list[int],
        prompt: VoicePrompt,
        params: GenerationParams,
        schedule: tuple[int, ...] = (3, 12),
    ) -> None:
        """Give ``owner`` a slot and a stream. Raises ValueError for bad input (nothing is kept then)."""
        sizes = chunk_sizes(schedule)
        if owner in self.live:
            raise ValueError(f"stream {owner!r} already exists")
        handle = self.table.allocate(owner)
        try:
            stream = self.gen.new_stream(handle.slot, tokens, prompt, params)
        except Exception:
            self.table.release(handle)
            raise
        self.live[owner] = _Live(handle, stream, sizes, next(sizes))

    def drop(self, owner) -> bool:
        """Free ``owner``'s slot (finished, cancelled or failed). Returns False if it had none."""
        live = self.live.pop(owner, None)
        if live is None:
            return False
        self.table.release(live.handle)
        return True

    def step(self, owners: list) -> dict:
        """One generator step for ``owners``; returns owner -> :class:`Emission`. Finished streams are freed."""
        lives = [self.live[o] for o in owners]
        for lv in lives:
            self.table.check(lv.handle)
        results = self.gen.step([lv.stream for lv in lives])
        out = {}
        for owner, lv, r in zip(owners, lives, results):
            if r.latents is not None:
                lv.pending.append(r.latents)
            due = lv.pending and (len(lv.pending) >= lv.want or r.finished)
            chunk = None
            if due:
                chunk = torch.cat(lv.pending).float().cpu().numpy()
                lv.pending, lv.want = [], next(lv.sizes)
            out[owner] = Emission(chunk, r.finished, r.reason)
            if r.finished:
                self.drop(owner)
        return out


@dataclass
class _Voc:
    decoder: PrimedDecoder
    last_seen: float


class VocoderService:
    """Per-stream decoders. Priming (decoding the whole prompt) is done once per distinct prompt and
    kept in a small LRU: streams of a stored voice start from a copy of the primed state."""

    def __init__(self, tts: FireRedTTS3, idle_seconds: float = 60.0, primed_cache: int = 32):
        self.tts = tts
        self.idle_seconds = idle_seconds
        self.streams: dict[int | str, _Voc] = {}
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
        decoder = self.tts.decoder_stream(torch.from_numpy(lat))
        if self.primed_cache > 0:
            self.primed[key] = decoder.clone()
            while len(self.primed) > self.primed_cache:
                self.primed.popitem(last=False)
        return decoder

    @property
    def active(self) -> int:
        return len(self.streams)

    @torch.inference_mode()
    def process(self, owner, latents: np.ndarray, start: bool, end: bool, prompt_latents: np.ndarray | None):
        """One chunk of one stream -> float32 samples finished by it (all the rest with ``end``)."""
        out = self.process_many([(owner, latents, start, end, prompt_latents)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def process_many(self, items: list[tuple]) -> list:
        """Chunks of several streams, as (owner, latents, start, end, prompt_latents) each.

        Streams past their priming transient whose chunks have the same length are decoded in one
        batched forward; the rest one by one. Returns, per item, float32 samples or the exception that
        failed that item alone.
        """
        now = time.monotonic()
        results: list = [None] * len(items)
        parts: list[list] = [[] for _ in items]
        todo = []
        for i, (owner, latents, start, _end, prompt_latents) in enumerate(items):
            try:
                if start:
                    if prompt_latents is None or len(prompt_latents) == 0:
                        raise ValueError("START needs PROMPT_LATENTS")
                    self.streams.pop(owner, None)  # a restarted id begins afresh
                    self.streams[owner] = _Voc(self._primed(prompt_latents), now)
                voc = self.streams.get(owner)
                if voc is None:
                    raise ValueError(
                        f"vocoder stream {owner} is unknown (not started, ended, or reclaimed after idling)"
                    )
                voc.last_seen = now
                if len(latents):
                    todo.append(i)
            except Exception as e:
                results[i] = e
        groups: dict[int, list[int]] = {}
        for i in todo:
            groups.setdefault(len(items[i][1]), []).append(i)
        for idx in groups.values():
            decs = [self.streams[items[i][0]].decoder for i in idx]
            if joinable([d.stream for d in decs]) and all(d.to_skip == 0 for d in decs):
                lat = np.stack([np.ascontiguousarray(items[i][1], np.float32) for i in idx])
                try:
                    audio = decode_together(
                        [d.stream for d in decs], torch.from_numpy(lat).to(self.tts.device, self.tts.dtype)
                    )
                except Exception as e:  # nothing was changed: fail these chunks only
                    for i in idx:
                        results[i] = e
                    continue
                audio = audio.float().cpu().numpy()
                for row, i in enumerate(idx):
                    parts[i].append(audio[row])
                self.batched_rows += len(idx)
                continue
            for i, d in zip(idx, decs, strict=True):
                try:
                    parts[i].append(d.decode(torch.from_numpy(np.ascontiguousarray(items[i][1], np.float32))))
                except Exception as e:
                    results[i] = e
        for i, (owner, _lat, _start, end, _prompt) in enumerate(items):
            if results[i] is not None:
                self.streams.pop(owner, None)
                continue
            if end:
                parts[i].append(self.streams.pop(owner).decoder.finish())
            results[i] = np.concatenate(parts[i]) if parts[i] else np.zeros(0, np.float32)
        return results

    def drop(self, owner) -> bool:
        return self.streams.pop(owner, None) is not None

    def reap(self) -> list:
        """Drop streams idle longer than ``idle_seconds``; returns their ids."""
        cutoff = time.monotonic() - self.idle_seconds
        dead = [o for o, v in self.streams.items() if v.last_seen < cutoff]
        for o in dead:
            del self.streams[o]
        return dead
