"""A model serving synthetic math (``--synthetic-math``, engine.synthetic) says so where operators look:
a warning in the server's log and the gauge ``tts_synthetic_math{model="..."} 1`` on the metrics port."""

from __future__ import annotations

import logging

from engine.synthetic import BANNER


def announce(pb, log: logging.Logger, model: str) -> tuple:
    """Log the banner and set the gauge; returns what must be kept alive for Triton to keep the gauge."""
    log.warning("%s: %s", model, BANNER)
    family = pb.MetricFamily(
        "tts_synthetic_math",
        "1: this model's math is replaced by ready-made output (benchmarks only, no speech)",
        pb.MetricFamily.GAUGE,
    )
    gauge = family.Metric(labels={"model": model})
    gauge.increment(1)  # not Metric.set, which keeps the GIL through its round trip (docs/triton.md#T19)
    return family, gauge
