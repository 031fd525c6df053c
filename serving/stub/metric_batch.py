"""Triton metrics in the stubs: every model's metric families, held for its life and dropped in its
``finalize``; metric updates of one event-loop turn sent together (:class:`MetricBatch`), gauges moved by
``increment`` (:class:`Level`); ``tts``'s metrics; the synthetic-math banner. Why: docs/architecture.md,
"Inside each stub". No Triton here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging

log = logging.getLogger("tts")
FIRST_CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
FAMILIES: dict = {}  # name -> this process's metric family (a stub serves one model); nothing else holds them


def family(pb, name: str, description: str, kind: str):
    """A ``pb.MetricFamily`` of ``kind`` (COUNTER, GAUGE or HISTOGRAM), held in :data:`FAMILIES` (Triton keeps
    a metric only while its family lives). Keep its metrics, never the family (look it up by name)."""
    FAMILIES[name] = pb.MetricFamily(name, description, getattr(pb.MetricFamily, kind))
    return FAMILIES[name]


def drop_families() -> None:
    """In a model's ``finalize``, once nothing updates its metrics any more: a family destroyed in the stub's
    destructor segfaults the stub on Triton 2.51 (python_backend PR #429, fixed after 2.51). Ending a family
    ends its metrics, so their own later end is safe."""
    FAMILIES.clear()
    gc.collect()


class MetricBatch:
    """``increment``, ``observe`` (Triton metrics) and ``set`` (a :class:`Level`), sent at the end of the loop's turn (at
    once when no loop runs). Used from one event loop only. ``threaded``: the round trips themselves go out on
    a thread of their own, in order, so that the loop never waits for Triton's process (an ``observe`` per
    request on the loop took a fifth of its busy time with hundreds of streams starting together)."""

    def __init__(self, threaded: bool = False):
        self.adds: dict = {}  # metric -> amount not sent yet
        self.values: dict = {}  # Level -> value not sent yet
        self.observed: list = []  # (histogram, value) not sent yet
        self.scheduled = False
        self.sender = concurrent.futures.ThreadPoolExecutor(1, "metrics") if threaded else None

    def increment(self, metric, amount: float) -> None:
        self.adds[metric] = self.adds.get(metric, 0) + amount
        self._schedule()

    def set(self, gauge: Level, value: float) -> None:
        self.values[gauge] = value
        self._schedule()

    def observe(self, histogram, value: float) -> None:
        self.observed.append((histogram, value))
        self._schedule()

    def _schedule(self) -> None:
        if self.scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        loop.call_soon(self.flush)
        self.scheduled = True

    def flush(self) -> None:
        self.scheduled = False
        adds, self.adds = self.adds, {}
        values, self.values = self.values, {}
        observed, self.observed = self.observed, []
        calls = [(metric.increment, amount) for metric, amount in adds.items() if amount]
        calls += [(gauge.set, value) for gauge, value in values.items()]  # each Level sends only a change
        calls += [(histogram.observe, value) for histogram, value in observed]
        if calls and self.sender is not None:
            self.sender.submit(_send, calls)
        elif calls:
            _send(calls)


def _send(calls: list) -> None:
    for call, value in calls:
        try:
            call(value)
        except Exception:  # noqa: BLE001 (a metric that could not be updated is no reason to fail anything)
            log.exception("a metric update failed")


class Level:
    """A Triton gauge set from any one thread, moved by ``increment`` of the difference from the value it
    was last moved to (never ``set``: docs/triton.md#T19), and not at all when the value is unchanged."""

    def __init__(self, gauge, value: float = 0.0):
        self.gauge, self.value = gauge, 0.0  # a Triton metric starts at 0
        self.set(value)

    def set(self, value: float) -> None:
        if delta := value - self.value:
            self.gauge.increment(delta)
            self.value = value


class TTSMetrics:
    """Requests by outcome, the gauges of requests in flight, waiting and text-in streams open, the audio
    streamed and the first chunk's latency, moved by ``batch`` (a :class:`MetricBatch`)."""

    def __init__(self, pb, batch):
        self.batch = batch
        requests = family(pb, "tts_requests_total", "tts requests by outcome", "COUNTER")
        self.outcome = {k: requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.in_flight, self.waiting, self.open = (Level(family(pb, *g, "GAUGE").Metric()) for g in (
            ("tts_requests_in_flight", "tts requests holding an admission place"),
            ("tts_requests_waiting", "tts requests with no audio sent yet"),
            ("tts_text_streams_open", "text-in streams open")))  # fmt: skip
        self.counts = [0, 0]  # requests in flight, waiting
        self.audio_seconds = family(pb, "tts_audio_seconds_total", "audio streamed", "COUNTER").Metric()
        self.first_chunk = family(pb, "tts_first_chunk_seconds", "request arrival to first audio chunk sent",
                                  "HISTOGRAM").Metric(buckets=FIRST_CHUNK_BUCKETS)  # fmt: skip

    def count(self, in_flight: int, waiting: int) -> None:
        """Requests that took (1) or gave back (-1) an admission place, or began (-1) to wait for audio."""
        self.counts[0] += in_flight
        self.counts[1] += waiting
        self.batch.set(self.in_flight, self.counts[0])
        self.batch.set(self.waiting, self.counts[1])

    def streams_open(self, n: int) -> None:
        self.batch.set(self.open, n)


def announce(pb, log: logging.Logger, model: str) -> Level:
    """A model serving synthetic math (``--synthetic-math``, engine.synthetic) says so where operators look:
    a warning in the log and the gauge ``tts_synthetic_math{model="..."} 1``."""
    from engine.synthetic import BANNER  # only a model serving synthetic math imports it

    log.warning("%s: %s", model, BANNER)
    about = "1: this model's math is replaced by ready-made output (benchmarks only, no speech)"
    return Level(family(pb, "tts_synthetic_math", about, "GAUGE").Metric(labels={"model": model}), 1)
