"""Triton metrics in the stubs (T19, T30): families held and released, updates batched per event-loop turn
(:class:`MetricBatch`), gauges moved by ``increment`` (:class:`Level`), ``tts``'s and the generator's metrics.
docs/architecture.md, "Inside each stub". No Triton here."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time

log = logging.getLogger("tts")
FIRST_CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
STEP_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
ATTENTION = "tts_generator_attention"
HELD_EVERY_SECONDS = 1.0  # the held-response counters are sent at most this often (each send is a round trip)
FAMILIES: dict = {}  # name -> this process's metric family (a stub serves one model); nothing else holds them


def family(pb, name: str, description: str, kind: str):
    """A ``pb.MetricFamily`` of ``kind`` (COUNTER, GAUGE or HISTOGRAM), held in :data:`FAMILIES` (Triton keeps
    a metric only while its family lives). Keep its metrics, never the family (look it up by name)."""
    FAMILIES[name] = pb.MetricFamily(name, description, getattr(pb.MetricFamily, kind))
    return FAMILIES[name]


def release(model) -> None:
    """The end of a model's ``finalize``, once nothing updates its metrics: all it holds, its metrics and their
    families included, is let go of now, while the stub can still tell Triton (one left to the stub's end
    segfaults it: docs/triton.md#T30)."""
    vars(model).clear()
    FAMILIES.clear()
    gc.collect()


class MetricBatch:
    """``increment``, ``observe`` (Triton metrics) and ``set`` (a :class:`Level`), sent at the end of the event
    loop's turn (at once when no loop runs), from one event loop. ``threaded``: the round trips go out on a
    thread of their own, in order (an ``observe`` per request on the loop took a fifth of its busy time with
    hundreds of streams starting together)."""

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
    """tts's metrics (docs/operations.md, "Metrics"), moved by ``batch`` (a :class:`MetricBatch`)."""

    def __init__(self, pb, batch, window=None):  # window: the start window (engine.start_window), if any
        self.batch, self.window = batch, window
        requests = family(pb, "tts_requests_total", "tts requests by outcome", "COUNTER")
        self.outcome = {k: requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.in_flight, self.waiting, self.open, self.places = (Level(family(pb, *g, "GAUGE").Metric()) for g in (
            ("tts_requests_in_flight", "tts requests holding an admission place"),
            ("tts_requests_waiting", "tts requests with no audio sent yet"),
            ("tts_text_streams_open", "text-in streams open"),
            ("tts_start_window", "requests that may be between their start and first audio at once (0: no window)")))  # fmt: skip
        self.late, self.queued = (Level(family(pb, *c, "COUNTER").Metric()) for c in (
            ("tts_start_late_chunks_total", "chunks handed on with their listener under 50 ms from running dry"),
            ("tts_start_queued_rounds_total", "rounds of the start window with a standing queue on the way out")))  # fmt: skip
        if window is not None:
            self.places.set(window.limit)
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
        if self.window is not None:  # it moves with what the way out says: docs/architecture.md, The start window
            self.batch.set(self.places, self.window.limit)
            self.batch.set(self.late, self.window.late)
            self.batch.set(self.queued, self.window.congested)

    def streams_open(self, n: int) -> None:
        self.batch.set(self.open, n)


class GeneratorMetrics:
    """The generator's metrics (docs/operations.md, "Metrics"), kept in step with its GeneratorService."""

    def __init__(self, pb, service):
        self.service = service

        def metric(name: str, about: str, kind: str = "GAUGE", **made):
            return family(pb, name, about, kind).Metric(**made)

        # gauges move by increment, never Metric.set (it keeps the GIL through its round trip: docs/triton.md#T19)
        self.active = Level(metric("tts_generator_active_slots", "generator slots holding a stream"))
        self.slots = Level(metric("tts_generator_slots", "generator slots served"), service.slots)
        self.step = metric("tts_generator_step_seconds", "wall time of one batched generator step", "HISTOGRAM",
                           buckets=STEP_BUCKETS)  # fmt: skip
        self.stream_steps = metric("tts_generator_stream_steps_total", "streams stepped, summed over the "
                                   "generator's steps (/ steps: mean batch)", "COUNTER")  # fmt: skip
        pages = service.scheduler.blocks.num_pages
        self.pages = Level(metric("tts_kv_pages", "pages of the backbone's KV cache"), pages)
        self.in_use = Level(metric("tts_kv_pages_in_use", "KV-cache pages holding positions of live streams"))
        self.waiting = Level(metric("tts_generator_waiting_for_kv", "streams holding a slot, waiting for KV pages"))
        family(pb, ATTENTION, "attention path in use (why not FlashInfer)", "GAUGE")  # a gauge per path, 1 in use
        self.attention_shown: tuple[str, str] | None = None
        self.attention = None
        waited = "waiting for their reader to read the one before"
        self.held = Level(metric("tts_generator_held_responses", f"responses {waited}"))
        self.holds = metric("tts_generator_held_responses_total", f"responses that waited {waited[8:]}", "COUNTER")
        about = "time those responses waited, summed (/ their count: the mean wait)"
        self.held_seconds = metric("tts_generator_held_seconds_total", about, "COUNTER")
        self.unsent = [0, 0.0]  # holds and their seconds not sent yet
        self.sent_at = time.monotonic()
        self.update()

    def waited(self, seconds: float) -> None:
        """A response went out after waiting ``seconds`` for its reader's receipt."""
        self.unsent[0] += 1
        self.unsent[1] += seconds

    def stepped(self, seconds: float, streams: int) -> None:
        """One batched step of ``streams`` streams took ``seconds``."""
        self.step.observe(seconds)
        self.stream_steps.increment(streams)

    def update(self, held: int = 0) -> None:
        """After admissions, steps and drops: the gauges follow the service (``held``: responses waiting for
        a receipt now). Moved only when they change (each move is a round trip to Triton's process, and
        this runs after every step)."""
        s = self.service
        self.held.set(held)
        if self.unsent[0] and time.monotonic() - self.sent_at >= HELD_EVERY_SECONDS:
            self.holds.increment(self.unsent[0])
            self.held_seconds.increment(self.unsent[1])
            self.unsent, self.sent_at = [0, 0.0], time.monotonic()
        self.active.set(s.active)
        self.in_use.set(s.scheduler.blocks.pages_in_use)
        self.waiting.set(len(s.waiting))
        now = (s.gen.attention, s.gen.attention_fallback_reason)
        if now != self.attention_shown:  # a failed FlashInfer run switches the path mid-run
            if self.attention is not None:
                self.attention.set(0)
            labels = {"backend": now[0], "fallback_reason": now[1] or "none"}
            self.attention = Level(FAMILIES[ATTENTION].Metric(labels=labels), 1)
            self.attention_shown = now


def announce(pb, log: logging.Logger, model: str) -> Level:
    """A model serving synthetic math (``--synthetic-math``, engine.synthetic) says so where operators look:
    a warning in the log and the gauge ``tts_synthetic_math{model="..."} 1``."""
    from engine.synthetic import BANNER  # only a model serving synthetic math imports it

    log.warning("%s: %s", model, BANNER)
    about = "1: this model's math is replaced by ready-made output (benchmarks only, no speech)"
    return Level(family(pb, "tts_synthetic_math", about, "GAUGE").Metric(labels={"model": model}), 1)
