"""Closed-loop load at a fixed concurrency: ``concurrency`` threads each stream one utterance after another
until ``requests`` streams are done; every stream's first-chunk latency, duration and audio length.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from client import SAMPLE_RATE, TTSClient


@dataclass(frozen=True)
class StreamResult:
    first_chunk: float | None  # seconds from sending the request to the first audio chunk; None: no audio
    total: float  # seconds from sending the request to the end of the stream
    audio: float  # seconds of audio received (24 kHz samples / 24000)
    error: str | None  # the client's exception, None for a complete stream
    worst_gap: float = 0.0  # longest silence a listener playing from the first chunk on would hear, s


def worst_gap(arrivals: list[float], seconds: list[float]) -> float:
    """The longest a listener would wait for audio (0.0: never), playing each chunk as it comes from the
    first chunk's arrival on, the first chunk being the only buffer.

    ``arrivals``: each chunk's arrival time (s); ``seconds``: its audio (s). A chunk arriving at t after
    ``received`` s of audio came, when (t - arrivals[0]) > ``received``, leaves the listener silent for the
    difference (an underrun); later chunks are then heard that much later.
    """
    heard_until, gap = None, 0.0  # when the audio received so far runs out
    for t, length in zip(arrivals, seconds, strict=True):
        if heard_until is None:
            heard_until = t
        elif t > heard_until:
            gap, heard_until = max(gap, t - heard_until), t
        heard_until += length
    return gap


@dataclass(frozen=True)
class LevelResult:
    concurrency: int  # streams in flight at once
    wall: float  # seconds from the first request sent to the last stream ended
    streams: tuple[StreamResult, ...]

    def summary(self) -> dict:
        """The table row: latencies in ms, RTF = a stream's wall time / its audio time (< 1: faster than
        real time), throughput = audio seconds delivered per wall second over all streams."""
        ok = [s for s in self.streams if s.error is None]
        first = np.array([s.first_chunk for s in ok], float) * 1000
        rtf = np.array([s.total / s.audio for s in ok if s.audio > 0], float)

        def pct(a, q):
            return float(np.percentile(a, q)) if a.size else float("nan")

        return {
            "concurrency": self.concurrency,
            "requests": len(self.streams),
            "errors": len(self.streams) - len(ok),
            "first_chunk_ms": {"p50": pct(first, 50), "p90": pct(first, 90), "p99": pct(first, 99)},
            "rtf": {"p50": pct(rtf, 50), "p90": pct(rtf, 90)},
            "underruns": sum(s.worst_gap > 0 for s in ok),  # streams a listener would hear stall at least once
            "worst_gap_ms": 1000 * max((s.worst_gap for s in ok), default=float("nan")),
            "audio_s_per_wall_s": sum(s.audio for s in ok) / self.wall if self.wall > 0 else float("nan"),
            "audio_s": sum(s.audio for s in ok),
            "wall_s": self.wall,
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "streams": [asdict(s) for s in self.streams]}


def one_stream(client: TTSClient, text: str, seed: int, request: dict) -> StreamResult:
    t0 = time.perf_counter()
    first, samples, arrivals, seconds = None, 0, [], []
    try:
        for chunk in client.stream(text, seed=seed, **request):
            first = chunk.arrival if first is None else first
            samples += chunk.audio.size
            if chunk.audio.size:  # an empty chunk brings nothing to play
                arrivals.append(chunk.arrival)
                seconds.append(chunk.audio.size / SAMPLE_RATE)
        if first is None:
            raise RuntimeError("the stream ended without audio")
    except Exception as e:  # a failed stream is a data point (an error), not the end of the benchmark
        return StreamResult(first, time.perf_counter() - t0, samples / SAMPLE_RATE, f"{type(e).__name__}: {e}")
    return StreamResult(first, time.perf_counter() - t0, samples / SAMPLE_RATE, None, worst_gap(arrivals, seconds))


def run_level(
    client: TTSClient, concurrency: int, requests: int, texts: list[str], request: dict,
    progress: Callable[[int, int, int], None] | None = None,
) -> LevelResult:  # fmt: skip
    """``requests`` streams with at most ``concurrency`` in flight; ``progress(done, errors, requests)``
    is called after each stream."""
    lock, done, errors = threading.Lock(), [0], [0]

    def job(i: int) -> StreamResult:
        r = one_stream(client, texts[i % len(texts)], seed=i, request=request)
        with lock:
            done[0] += 1
            errors[0] += r.error is not None
            if progress:
                progress(done[0], errors[0], requests)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"bench-c{concurrency}") as pool:
        results = tuple(pool.map(job, range(requests)))
    return LevelResult(concurrency, time.perf_counter() - t0, results)


def console_progress(concurrency: int, stream=sys.stderr) -> Callable[[int, int, int], None]:
    """A counter rewritten in place on a terminal; elsewhere a line per quarter of the level."""
    tty = stream.isatty()

    def show(done: int, errors: int, total: int) -> None:
        line = f"  concurrency {concurrency:>3}: {done}/{total} streams, {errors} errors"
        if tty:
            print(f"\r{line}\033[K", end="" if done < total else "\n", file=stream, flush=True)
        elif done % max(1, total // 4) == 0 or done == total:
            print(line, file=stream, flush=True)

    return show
