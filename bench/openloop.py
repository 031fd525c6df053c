"""Open-loop load: requests arrive on a seeded Poisson schedule at a target rate, whatever the server is
doing, and each stream is judged as a listener would hear it.

At ``rate`` requests/s for ``duration`` s, the gaps between arrivals are exponential with mean
``1 / rate`` s, drawn up front from ``seed`` (:func:`poisson_arrivals`), and each arrival speaks a text
drawn (same seed) from :data:`MIXED_TEXTS`. A dispatcher starts every stream at its scheduled time on a
thread of its own, even while earlier streams are still running, so a slow server meets more streams at
once rather than fewer arrivals (a closed loop's concurrency hides exactly that). After ``duration`` the
streams in flight get ``drain_timeout`` s more to finish; the rest are cut and count as timeouts.

Per stream, as :func:`bench.load.one_stream` measures it: first audio, RTF, the worst gap (how long a
listener playing from the first chunk on, that chunk the only buffer, waits with nothing to play:
:func:`bench.load.worst_gap`), and the failure kind. A stream is *continuous* when no gap exceeds
:data:`CONTINUITY_GAP_S` (vLLM-Omni's "streaming continuity OK"); any gap at all is an *underrun*.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from bench.load import FAILURE_KINDS, StreamResult, one_stream, percentile
from client import TTSClient

# short replies and paragraphs (several sentences: the server speaks them as several segments), English and
# Chinese; each arrival draws one with equal chance
MIXED_TEXTS = (
    "Sure, I can help with that.",
    "好的，马上为您处理。",
    "Thanks for calling the support line. Your order left our warehouse this morning, and it should arrive "
    "within two business days. You will get a text message with a tracking link as soon as the courier scans "
    "the parcel. If it has not arrived by Friday, reply to the confirmation email and we will send a "
    "replacement at no cost. You can also change the delivery address until the parcel is out for delivery. "
    "Is there anything else I can help you with today?",
    "欢迎使用语音合成服务。今天的天气晴朗，最高气温二十五度，最低气温十六度，非常适合外出散步。"
    "下午可能会有一阵小雨，出门时请记得带伞。晚上风力逐渐加大，骑车的朋友请注意安全。"
    "明天将迎来一次明显的降温过程，请及时增添衣物。如果您还想了解其他城市的天气，请直接说出城市的名称。"
    "祝您度过愉快的一天，如有任何问题，请随时联系我们。",
)
CONTINUITY_GAP_S = 0.100  # a stream is continuous when no gap is longer than this, s (vLLM-Omni: 100 ms)
CLOCK_SLACK_S = 1e-6  # gaps are differences of float seconds: a gap of exactly 100 ms may read 100.0000000001
DURATION_S, DRAIN_TIMEOUT_S, SEED = 60.0, 120.0, 0  # the command lines' defaults


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start when the request is due
    text: str  # what it asks to speak
    seed: int  # the synthesis seed it sends (its index in the schedule)


def poisson_arrivals(rate: float, duration: float, seed: int, texts: tuple[str, ...] = MIXED_TEXTS) -> list[Arrival]:
    """The arrivals in ``[0, duration)`` s of a Poisson process at ``rate`` requests/s: exponential gaps of
    mean ``1 / rate`` s, the first one from 0. Depends on nothing but the arguments, so the same seed gives
    the same schedule whatever the server does."""
    if rate <= 0 or duration <= 0:
        raise ValueError(f"need rate > 0 requests/s and duration > 0 s, got {rate}, {duration}")
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return arrivals
        arrivals.append(Arrival(float(t), texts[int(rng.integers(len(texts)))], len(arrivals)))


def continuous(stream: StreamResult) -> bool:
    """No gap of more than :data:`CONTINUITY_GAP_S` after playback started (a complete stream)."""
    return stream.error is None and stream.worst_gap <= CONTINUITY_GAP_S + CLOCK_SLACK_S


@dataclass(frozen=True)
class ScheduledStream:
    arrival: Arrival
    sent: float  # seconds after the run's start when it was actually sent (>= arrival.at)
    result: StreamResult


@dataclass(frozen=True)
class RateLevelResult:
    rate: float  # target arrivals per second
    duration: float  # seconds over which arrivals were scheduled
    wall: float  # seconds from the run's start to the end of its last stream (drain included), >= duration
    streams: tuple[ScheduledStream, ...]

    def summary(self) -> dict:
        """The table row: latencies in ms; RTF = a stream's wall time / its audio time; achieved req/s =
        complete streams / ``wall`` (below the target by the streams still running after ``duration``);
        underruns and continuity over complete streams; failures by :data:`bench.load.FAILURE_KINDS`."""
        results = [s.result for s in self.streams]
        ok = [r for r in results if r.error is None]
        first = [1000 * r.first_chunk for r in ok]
        rtf = [r.total / r.audio for r in ok if r.audio > 0]
        failures = {kind: sum(r.failure == kind for r in results) for kind in FAILURE_KINDS}
        return {
            "rate": self.rate,
            "requests": len(results),
            "offered_rps": len(results) / self.duration,
            "complete": len(ok),
            "errors": len(results) - len(ok),
            "failures": failures,
            "achieved_rps": len(ok) / self.wall if self.wall > 0 else float("nan"),
            "first_chunk_ms": {f"p{q}": percentile(first, q) for q in (50, 90, 95, 99)},
            "rtf": {f"p{q}": percentile(rtf, q) for q in (50, 95)},
            "underruns": sum(r.worst_gap > 0 for r in ok),
            "continuity_ok_rate": sum(map(continuous, ok)) / len(ok) if ok else float("nan"),
            "worst_gap_ms": 1000 * max((r.worst_gap for r in ok), default=float("nan")),
            "audio_s": sum(r.audio for r in ok),
            "duration_s": self.duration,
            "wall_s": self.wall,
            "start_lag_ms_max": 1000 * max((s.sent - s.arrival.at for s in self.streams), default=0.0),
        }

    def to_json(self) -> dict:
        streams = [{**asdict(s.result), "at": s.arrival.at, "sent": s.sent, "text": s.arrival.text}
                   for s in self.streams]  # fmt: skip
        return {"summary": self.summary(), "streams": streams}


def run_rate(
    client: TTSClient, arrivals: list[Arrival], rate: float, duration: float, request: dict,
    drain_timeout: float = DRAIN_TIMEOUT_S, progress: Callable[[int, int, int], None] | None = None,
) -> RateLevelResult:  # fmt: skip
    """Send each of ``arrivals`` at its time, each on its own thread; after ``duration`` s wait up to
    ``drain_timeout`` s for the streams in flight, then cut the rest (a timeout each: they end at their next
    chunk, or at the client's own timeout). ``progress(done, errors, total)`` is called after each stream."""
    cancel, lock, done, errors = threading.Event(), threading.Lock(), [0], [0]
    slots: list[ScheduledStream | None] = [None] * len(arrivals)
    t0 = time.perf_counter()

    def job(i: int, sent: float) -> None:
        result = one_stream(client, arrivals[i].text, arrivals[i].seed, request, cancel)
        slots[i] = ScheduledStream(arrivals[i], sent, result)
        with lock:
            done[0] += 1
            errors[0] += result.error is not None
            if progress:
                progress(done[0], errors[0], len(arrivals))

    threads = []
    for i, arrival in enumerate(arrivals):
        time.sleep(max(0.0, arrival.at - (time.perf_counter() - t0)))
        thread = threading.Thread(target=job, args=(i, time.perf_counter() - t0), name=f"bench-r{rate:g}-{i}")
        thread.start()
        threads.append(thread)
    drain_until = t0 + max(duration, time.perf_counter() - t0) + drain_timeout
    for thread in threads:
        thread.join(max(0.0, drain_until - time.perf_counter()))
    cancel.set()
    for thread in threads:  # each ends at its next chunk or at the client's timeout
        thread.join()
    streams = tuple(s for s in slots if s is not None)
    wall = max([duration] + [s.sent + s.result.total for s in streams])  # the run lasts its duration at least
    return RateLevelResult(rate, duration, wall, streams)


def add_open_loop_options(ap: argparse.ArgumentParser) -> None:
    """``--duration``, ``--seed`` and ``--drain-timeout``, as every open-loop command line spells them."""
    ap.add_argument("--duration", type=float, default=DURATION_S,
                    help=f"seconds of arrivals per rate (default {DURATION_S:g})")  # fmt: skip
    ap.add_argument("--seed", type=int, default=SEED, help=f"seed of the arrival schedule and texts (default {SEED})")
    ap.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                    help=f"seconds the streams in flight get to finish after --duration (default {DRAIN_TIMEOUT_S:g}); "
                    "the rest count as timeouts")  # fmt: skip


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` -> [0.5, 1.0, 2.0] (ValueError unless each is a number > 0)."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        raise ValueError(f"rates must be comma-separated numbers > 0, got {text!r}")
    return rates
