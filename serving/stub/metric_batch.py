"""Metric updates of one event-loop turn, sent together.

In the Python backend every ``Metric.increment`` and ``Metric.set`` is a round trip to Triton's process.
A ``tts`` request updated its gauges and counters about ten times; requests that start and end together
(a generator step's streams) updated the same metrics in the same turn of the event loop. Here the
updates of one turn are summed (counters) or superseded (gauges) and sent once, at the end of the turn,
and a gauge is not sent again at the value it already has. Values are the same as sent one by one, a
turn later at most. A gauge moves by ``increment`` (the difference from the value last sent), never by
``set``: Triton 2.51's ``Metric.set`` keeps the GIL through its round trip (docs/triton.md#T19). No Triton.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

log = logging.getLogger("tts")


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
