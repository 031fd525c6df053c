"""Vocoder requests that carry a batch of chunks: tts's side (:class:`BLSVocoder`) and the vocoder's
(:func:`rows`, :func:`answer`); docs/architecture.md, "Vocoder batching". No torch."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

import numpy as np

from engine.lifetime import linger
from engine.protocol import KINDS, Chunk, StreamFailed
from serving import contract

OUTPUTS = [s.name for s in contract.VOCODER_OUTPUTS]


def request_values(chunks: list[Chunk]) -> dict[str, np.ndarray]:
    """The vocoder's inputs for ``chunks`` (equal latents and prompt latents lengths), one row each, built a
    column at a time (``Spec.array`` per chunk cost ~40 us of tts's event loop)."""
    n = len(chunks)
    columns = {"STREAM_ID": [c.stream_id for c in chunks], "LATENTS": [c.latents for c in chunks],
               "PROMPT_LATENTS": [c.prompt_latents for c in chunks], "LAST": [c.last for c in chunks],
               "FINISH_REASON": [[c.finish_reason.encode("utf-8")] for c in chunks],
               "SEAL": [(c.seq, c.seal) for c in chunks]}  # fmt: skip
    return {s.name: np.array(columns[s.name], s.numpy_dtype).reshape(n, *s.dims) for s in contract.VOCODER_INPUTS}


def rows(tensor: Callable[[str], np.ndarray | None]) -> list[Callable[[str], np.ndarray | None]]:
    """A vocoder request's inputs (``tensor(name)``, batch first) -> one accessor per row, as
    :func:`serving.stub.triton_io.read_chunk` takes it; ValueError when the inputs disagree on the batch."""
    batch = tensor("STREAM_ID")
    if batch is None or batch.size <= 1:  # one chunk, however its sender shaped it (HTTP generate flattens)
        return [tensor]
    n = len(batch)
    arrays = {s.name: tensor(s.name) for s in contract.VOCODER_INPUTS}
    for name, value in arrays.items():
        if value is not None and (value.ndim == 0 or len(value) != n):
            raise ValueError(f"{name} must have one row per chunk ({n}), got shape {value.shape}")
    return [lambda name, i=i: None if arrays.get(name) is None else arrays[name][i] for i in range(n)]


def answer(results: list[tuple[np.ndarray | None, str]]) -> dict[str, np.ndarray]:
    """Per row (samples or None, finish reason) -> the response's outputs: AUDIO padded with zeros to the
    longest row, FINISH_REASON and SAMPLES."""
    lengths = [0 if audio is None else len(audio) for audio, _ in results]
    audio = np.zeros((len(results), max(lengths, default=0)), np.float32)
    for row, (samples, _) in enumerate(results):
        if samples is not None:
            audio[row, : len(samples)] = samples
    reasons = np.array([[reason.encode("utf-8")] for _, reason in results], np.object_).reshape(-1, 1)
    return {"AUDIO": audio, "FINISH_REASON": reasons, "SAMPLES": np.array(lengths, np.int32).reshape(-1, 1)}


class BLSVocoder:
    """The orchestrator's vocoder over BLS: the ``decode`` calls of one turn of the event loop go out at its
    end, one request per shape of at most ``most`` chunks."""

    def __init__(self, bls, most: int):
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.bls, self.most = bls, most
        self.waiting: list[tuple[Chunk, asyncio.Future]] = []

    async def decode(self, chunk: Chunk) -> np.ndarray:
        loop = asyncio.get_running_loop()
        if not self.waiting:  # the first of this turn: the callbacks already due this turn run first
            loop.call_soon(self.flush)
        answered = loop.create_future()
        self.waiting.append((chunk, answered))
        return await answered  # a caller cancelled meanwhile: its chunk is sent all the same

    def flush(self) -> None:
        """Send what waits, one request per shape (equal LATENTS and PROMPT_LATENTS lengths)."""
        groups: dict[tuple[int, int], list] = {}
        for item in self.waiting:
            groups.setdefault((len(item[0].latents), len(item[0].prompt_latents)), []).append(item)
        self.waiting = []
        for group in groups.values():
            for start in range(0, len(group), self.most):
                # serves many requests: none of them waits for it as its own cleanup (LINGERING)
                contextvars.Context().run(linger, self._send(group[start : start + self.most]))

    async def _send(self, group: list[tuple[Chunk, asyncio.Future]]) -> None:
        chunks = [c for c, _ in group]
        results: list = [RuntimeError("the vocoder request was cut short")] * len(chunks)
        try:
            inputs = [self.bls.pb.Tensor(name, value) for name, value in request_values(chunks).items()]
            results = split(await self.bls.call("vocoder", inputs, OUTPUTS, decoupled=True), chunks)
        except Exception as e:  # the request failed: so did every chunk in it
            results = [e] * len(chunks)
        finally:  # every caller gets an answer, whatever happened
            for (_, answered), result in zip(group, results, strict=True):
                if not answered.done():  # (else its caller was cancelled)
                    (answered.set_exception if isinstance(result, Exception) else answered.set_result)(result)


def split(out: dict[str, np.ndarray], chunks: list[Chunk]) -> list[np.ndarray | Exception]:
    """A vocoder response -> per chunk its samples, or the StreamFailed of its refusal or failure."""
    audio, samples = out["AUDIO"], out["SAMPLES"].reshape(-1)  # (rows, longest), (rows,)
    if len(audio) != len(chunks) or len(samples) != len(chunks):
        raise RuntimeError(f"vocoder: {len(chunks)} chunks sent, {len(audio)} answered")
    reasons = [contract.text_of(reason) for reason in out["FINISH_REASON"]]
    failed = [r.startswith(KINDS) and r != c.finish_reason for c, r in zip(chunks, reasons, strict=True)]
    return [StreamFailed(r) if f else audio[i, : int(samples[i])] for i, (r, f) in enumerate(zip(reasons, failed))]
