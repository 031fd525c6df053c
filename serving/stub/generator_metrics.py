"""The generator model's Prometheus metrics (each is described in docs/operations.md, "Metrics"), kept in step
with its :class:`~engine.streams.GeneratorService`."""

from __future__ import annotations

import time

from serving.stub.metric_batch import FAMILIES, Level, family

STEP_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
ATTENTION = "tts_generator_attention"
HELD_EVERY_SECONDS = 1.0  # the held-response counters are sent at most this often (each send is a round trip)


class GeneratorMetrics:
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
        self.held_seconds = metric("tts_generator_held_seconds_total",
                                   "time those responses waited, summed (/ their count: the mean wait)", "COUNTER")  # fmt: skip
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
