"""Metric updates of one event-loop turn, sent together.

In the Python backend every ``Metric.increment`` and ``Metric.set`` is a round trip to Triton's process.
A ``tts`` request updated its gauges and counters about ten times; requests that start and end together
(a generator step's streams) updated the same metrics in the same turn of the event loop. Here the
updates of one turn are summed (counters) or superseded (gauges) and sent once, at the end of the turn,
and a gauge is not sent again at the value it already has. Values are the same as sent one by one, a
turn later at most. No Triton.
"""

from __future__ import annotations

import asyncio


class MetricBatch:
    """``increment`` and ``set`` on Triton metrics, sent at the end of the event loop's turn (at once when
    no loop runs). Used from one event loop only."""

    def __init__(self):
        self.adds: dict = {}  # metric -> amount not sent yet
        self.values: dict = {}  # gauge -> value not sent yet
        self.sent: dict = {}  # gauge -> the value last sent
        self.scheduled = False

    def increment(self, metric, amount: float) -> None:
        self.adds[metric] = self.adds.get(metric, 0) + amount
        self._schedule()

    def set(self, gauge, value: float) -> None:
        self.values[gauge] = value
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
        for metric, amount in adds.items():
            if amount:
                metric.increment(amount)
        for gauge, value in values.items():
            if self.sent.get(gauge) != value:
                gauge.set(value)
                self.sent[gauge] = value
