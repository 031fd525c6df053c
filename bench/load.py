"""Closed-loop load at a fixed concurrency: ``concurrency`` threads each stream one utterance after another
until ``requests`` streams are done; every stream's first-chunk latency, duration and audio length.

Also what every load mode shares (:mod:`bench.openloop` is the open-loop one): one stream as a listener
hears it (:func:`one_stream`, :func:`worst_gap`) and the kind of a failed stream (:func:`failure_kind`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from client import SAMPLE_RATE, TTSClient, TTSError
from engine.protocol import INVALID, UNAVAILABLE

# why a stream failed, in the order tables show them:
#   busy: the server refused or ended it as `unavailable:` (queue full, restarting, shutting down; retry shortly;
#         one in-band tag covers all three, and no message wording is read to tell them apart)
#   invalid: the server said the request was bad (`invalid:`)
#   unavailable: no server answered, or the connection broke (the client's ConnectionError)
#   error: the server failed (`error:`, or Triton's untagged messages), or the stream ended without audio
#   timeout: no response within the client's timeout, or still streaming when the bench stopped waiting
FAILURE_KINDS = ("busy", "invalid", "unavailable", "error", "timeout")


@dataclass(frozen=True)
class StreamResult:
    first_chunk: float | None  # seconds from sending the request to the first audio chunk; None: no audio
    total: float  # seconds from sending the request to the end of the stream
    audio: float  # seconds of audio received (24 kHz samples / 24000)
    error: str | None  # the client's exception, None for a complete stream
    worst_gap: float = 0.0  # longest silence a listener playing from the first chunk on would hear, s
    failure: str | None = None  # one of FAILURE_KINDS for a failed stream, None for a complete one


def failure_kind(exc: BaseException) -> str:
    """The :data:`FAILURE_KINDS` entry of a stream's exception: by the client's exception type and the
    server's in-band tag (``TTSError.kind``), never by the wording of a message."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):
        return "unavailable"
    if isinstance(exc, TTSError) and exc.kind == UNAVAILABLE:
        return "busy"
    if isinstance(exc, TTSError) and exc.kind == INVALID:
        return "invalid"
    return "error"


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100, linear interpolation between ranks) of ``values``; NaN when empty."""
    a = np.asarray(values, float)
    return float(np.percentile(a, q)) if a.size else float("nan")


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
        pct = percentile
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


class Listener:
    """One stream as a listener hears it, fed chunk by chunk: what :func:`one_stream` and
    :func:`bench.aio_load.one_stream` (the asyncio client's) both judge a stream by."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.first: float | None = None  # the first chunk's arrival, s after t0
        self.samples, self.arrivals, self.seconds = 0, [], []

    def heard(self, chunk) -> None:
        """``chunk``: a :class:`client.Chunk` (its arrival measured from when the request was sent)."""
        self.first = chunk.arrival if self.first is None else self.first
        self.samples += chunk.audio.size
        if chunk.audio.size:  # an empty chunk brings nothing to play
            self.arrivals.append(chunk.arrival)
            self.seconds.append(chunk.audio.size / SAMPLE_RATE)

    def ended(self) -> None:
        if self.first is None:
            raise RuntimeError("the stream ended without audio")

    def result(self, error: BaseException | None = None) -> StreamResult:
        total, audio = time.perf_counter() - self.t0, self.samples / SAMPLE_RATE
        if error is not None:
            return StreamResult(self.first, total, audio, f"{type(error).__name__}: {error}",
                                failure=failure_kind(error))  # fmt: skip
        return StreamResult(self.first, total, audio, None, worst_gap(self.arrivals, self.seconds))


def one_stream(
    client: TTSClient, text: str, seed: int, request: dict, cancel: threading.Event | None = None
) -> StreamResult:
    """Stream ``text`` and time it as a listener hears it. ``request``: :meth:`TTSClient.stream`'s other
    keyword arguments. ``cancel``, once set, ends the stream at its next chunk as a timeout (leaving the
    loop closes the client's stream, which cancels the request on the server)."""
    listener = Listener()
    try:
        for chunk in client.stream(text, seed=seed, **request):
            if cancel is not None and cancel.is_set():
                raise TimeoutError("still streaming when the benchmark stopped waiting")
            listener.heard(chunk)
        listener.ended()
    except Exception as e:  # a failed stream is a data point (an error), not the end of the benchmark
        return listener.result(e)
    return listener.result()


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


def console_progress(level: int | str, stream=sys.stderr) -> Callable[[int, int, int], None]:
    """A counter rewritten in place on a terminal; elsewhere a line per quarter of the level. ``level``:
    a concurrency, or the level's own label (``"rate 2/s"``)."""
    tty = stream.isatty()
    label = f"concurrency {level:>3}" if isinstance(level, int) else level

    def show(done: int, errors: int, total: int) -> None:
        line = f"  {label}: {done}/{total} streams, {errors} errors"
        if tty:
            print(f"\r{line}\033[K", end="" if done < total else "\n", file=stream, flush=True)
        elif done % max(1, total // 4) == 0 or done == total:
            print(line, file=stream, flush=True)

    return show
