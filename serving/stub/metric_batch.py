"""Metric updates of one event-loop turn, sent together (docs/architecture.md, "Inside each stub"); ``tts``'s
metric families; the synthetic-math banner. No Triton here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

log = logging.getLogger("tts")
FIRST_CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]


class MetricBatch:
    """``increment``, ``set`` and ``observe`` on Triton metrics, sent at the end of the event loop's turn (at
    once when no loop runs). Used from one event loop only. ``threaded``: the round trips themselves go out on
    a thread of their own, in order, so that the loop never waits for Triton's process (an ``observe`` per
    request on the loop took a fifth of its busy time with hundreds of streams starting together)."""

    def __init__(self, threaded: bool = False):
        self.adds: dict = {}  # metric -> amount not sent yet
        self.values: dict = {}  # gauge -> value not sent yet
        self.observed: list = []  # (histogram, value) not sent yet
        self.sent: dict = {}  # gauge -> its value in Triton (0 until one is sent)
        self.scheduled = False
        self.sender = concurrent.futures.ThreadPoolExecutor(1, "metrics") if threaded else None

    def increment(self, metric, amount: float) -> None:
        self.adds[metric] = self.adds.get(metric, 0) + amount
        self._schedule()

    def set(self, gauge, value: float) -> None:
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
        for gauge, value in values.items():
            if delta := value - self.sent.get(gauge, 0):  # a Triton metric starts at 0
                calls.append((gauge.increment, delta))
                self.sent[gauge] = value
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
    streamed and the first chunk's latency."""

    def __init__(self, pb, batch):
        """``batch``: the :class:`MetricBatch` that moves them."""
        self.batch = batch
        self.requests = pb.MetricFamily("tts_requests_total", "tts requests by outcome", pb.MetricFamily.COUNTER)
        self.outcome = {k: self.requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.gauges = [
            pb.MetricFamily("tts_requests_in_flight", "tts requests holding an admission place", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_requests_waiting", "tts requests with no audio sent yet", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_text_streams_open", "text-in streams open", pb.MetricFamily.GAUGE),
        ]
        self.in_flight, self.waiting, self.open = (g.Metric() for g in self.gauges)
        self.counts = [0, 0]  # requests in flight, waiting
        self.audio_family = pb.MetricFamily("tts_audio_seconds_total", "audio streamed", pb.MetricFamily.COUNTER)
        self.audio_seconds = self.audio_family.Metric()
        self.first_family = pb.MetricFamily("tts_first_chunk_seconds", "request arrival to first audio chunk sent",
                                            pb.MetricFamily.HISTOGRAM)  # fmt: skip
        self.first_chunk = self.first_family.Metric(buckets=FIRST_CHUNK_BUCKETS)

    def count(self, in_flight: int, waiting: int) -> None:
        """Requests that took (1) or gave back (-1) an admission place, or began (-1) to wait for audio."""
        self.counts[0] += in_flight
        self.counts[1] += waiting
        self.batch.set(self.in_flight, self.counts[0])
        self.batch.set(self.waiting, self.counts[1])

    def streams_open(self, n: int) -> None:
        self.batch.set(self.open, n)


def announce(pb, log: logging.Logger, model: str) -> tuple:
    """A model serving synthetic math (``--synthetic-math``, engine.synthetic) says so where operators look:
    a warning in the log and the gauge ``tts_synthetic_math{model="..."} 1``. Returns what must be kept
    alive for Triton to keep the gauge."""
    from engine.synthetic import BANNER  # only a model serving synthetic math imports it

    log.warning("%s: %s", model, BANNER)
    family = pb.MetricFamily(
        "tts_synthetic_math",
        "1: this model's math is replaced by ready-made output (benchmarks only, no speech)",
        pb.MetricFamily.GAUGE,
    )
    return family, Level(family.Metric(labels={"model": model}), 1)
