"""The vocoder's per-stream service, used in-process (offline synthesis) and behind Triton alike:
:class:`VocoderService` keeps primed RedAE decoder state per stream, started by a stream's first
:class:`~engine.protocol.Chunk` and freed by its last one (or when it idles too long). Its chunks come
from :class:`engine.streams.GeneratorService`. No Triton here.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from engine.fireredtts3 import FireRedTTS3, PrimedDecoder
from engine.invariant import batch_invariant, install
from engine.models.redae import decode_together, joinable
from engine.protocol import LENGTH, STOP, Chunk


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

    def __init__(
        self, model: FireRedTTS3, idle_seconds: float = 60.0, primed_cache: int = 32, max_streams: int = 1024,
        batch_invariant: bool = False,
    ):  # fmt: skip
        self.model, self.batch_invariant = model, batch_invariant  # engine/invariant.py
        if batch_invariant:
            install(model.models.redae.decoder)
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
        with batch_invariant(self.batch_invariant):  # a chunk's audio the same bits decoded alone or together
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
