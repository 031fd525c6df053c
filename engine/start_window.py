"""Starts under load: how many utterances may be on their way to their first audio at once.

Why a window at all: a new stream's first chunks and every playing stream's next chunk share one delivery
path (the vocoder, the sends), and the generator runs a new stream far ahead of its listener. A burst of
new streams queues its chunks there in front of the next chunk of streams already playing, which then
stall. Holding a start back costs it first-audio latency, never a stall.

Why it is not only a fixed number: a window of W places, each held from a start to its first audio (about
four generator steps), admits at most W / (4 x step) starts a second. So a fixed window admits fewer starts
a second the slower the step, while what the delivery path can take is a rate of starts (each start puts
about five chunks on it in its first seconds: engine.chunking's doubling). The window is therefore the
larger of ``least`` (32: what the fixed window measured safe here) and that rate times the time a start
takes to reach its first audio when nothing queues (Little's law): ``W = max(least, rate x base)``, where
``base`` is the least time to first audio of the last :data:`BASE_STARTS` starts. ``base`` follows the step
and not the queue: a window that grew with queued time would let in more the more congested the path (a
start that waits in line is still counted in the window, so the starts in flight stay W and the path
self-clocks). The default rate, 96 starts a second, is what a 2-core machine's path carried at an 80 ms
step without a stall (docs/benchmarks.md, "The start window"); a window that let in more there (128 a
second and growing) gave first audio sooner but stalled listeners at 128 requests a second. A larger
machine can take a higher ``--start-rate``.

- **A late listener backs it off.** A playing stream whose chunk goes out when its listener holds less than
  ``late_seconds`` of audio (:meth:`played`) halves the rate part of the window (never below ``least``), at
  most once a round (the smoothed time to first audio); each round with no late listener gives back a tenth
  of what was taken.
- Waiting starts are admitted in arrival order, and a start that ends without audio (failed, cancelled)
  gives its place back and teaches the window nothing.

A listener is measured where the orchestrator hands its audio on: it holds what was sent minus the time
since its playback began, and one that runs dry starts again from its next chunk (the clock of
:mod:`engine.chunking`). A stream that waits for its own client (a text-in stream between turns) is not
late because of the server: the orchestrator watches a listener within a segment only (:meth:`stopped` at
each segment's end), and :meth:`played` with ``counted=False`` resumes one without a verdict.

Plain Python on one event loop (no torch); times are seconds of ``clock``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Hashable


class Start:
    """One start's place in the window, from :meth:`StartWindow.acquire` until its first audio or its end."""

    __slots__ = ("began", "done", "window")

    def __init__(self, window: StartWindow, began: float):
        self.window, self.began, self.done = window, began, False

    def delivered(self) -> None:
        """Its first audio (or its plan) is out: the place goes to the next start, and the window learns."""
        if not self.done:
            self.done = True
            self.window._ended(self, True)

    def abandoned(self) -> None:
        """It ended (failed, cancelled) before any audio: the place goes back, the window is left alone."""
        if not self.done:
            self.done = True
            self.window._ended(self, False)


BASE_STARTS = 256  # starts whose least time to first audio is the window's base
FIRST_GUESS_SECONDS = 0.25  # the base before any start has reached its first audio


class StartWindow:
    """Places for starts (see the module's description): ``rate`` starts a second times the base time to
    first audio, within ``least`` and ``most`` places."""

    def __init__(self, rate: float = 96.0, least: int = 32, most: int = 4096, late_seconds: float = 0.05,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if not rate > 0 or not 1 <= least <= most:
            raise ValueError(f"need rate > 0 and 1 <= least <= most, got {rate}, {least}, {most}")
        self.rate, self.least, self.most, self.late_seconds, self.clock = rate, least, most, late_seconds, clock
        self.penalty = 1.0  # what late listeners left of the window (0.5 after one, back to 1 a tenth a round)
        self.starting = 0  # places held
        self.waiting: deque[asyncio.Future] = deque()  # starts waiting for a place, oldest first
        self.listeners: dict[Hashable, float] = {}  # playing stream -> when its listener runs dry
        self.recent: deque[float] = deque(maxlen=BASE_STARTS)  # the latest starts' times to first audio
        self.first: float | None = None  # time to first audio, smoothed (None: none measured yet)
        self.backed_off = -float("inf")  # when the window last halved
        self.recovered = -float("inf")  # when it last gave some back
        self.late = 0  # late chunks seen (a counter for metrics and tests)

    @classmethod
    def of(cls, rate: float, share: int = 1) -> StartWindow | None:
        """A window for ``rate`` starts a second; None for 0 (no window). ``share``: the processes that start
        streams on one delivery path (tts's instances), each with this share of the rate and of ``least``."""
        return cls(rate / share, least=math.ceil(32 / share)) if rate else None

    @property
    def base(self) -> float:
        return min(self.recent) if self.recent else FIRST_GUESS_SECONDS

    @property
    def limit(self) -> int:
        return max(self.least, min(self.most, math.ceil(self.penalty * self.rate * self.base)))

    @property
    def round(self) -> float:
        return FIRST_GUESS_SECONDS if self.first is None else self.first

    async def acquire(self) -> Start:
        """A place for one start, waiting in arrival order while the window is full (cancellable)."""
        if not self.waiting and self.starting < self.limit:
            self.starting += 1
            return Start(self, self.clock())
        place = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        try:
            await place
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():  # granted as it was cancelled: pass the place on
                self.starting -= 1
                self._admit()
            elif place in self.waiting:
                self.waiting.remove(place)
            raise
        return Start(self, self.clock())

    def played(self, key: Hashable, seconds: float, counted: bool = True) -> None:
        """``seconds`` of stream ``key``'s audio go out now. Late if its listener held less than
        ``late_seconds`` (``counted``: False for a stream that waited for its own client)."""
        now = self.clock()
        runs_dry = self.listeners.get(key)
        if runs_dry is not None and counted and runs_dry - now < self.late_seconds:
            self.late += 1
            if now - self.backed_off >= self.round:
                self.backed_off = now
                self.penalty = max(self.penalty / 2, 1e-3)
        self.listeners[key] = max(now, runs_dry or now) + seconds

    def stopped(self, key: Hashable) -> None:
        """Stream ``key`` has no more audio (its end, or a wait for its client's text)."""
        self.listeners.pop(key, None)

    def _ended(self, start: Start, delivered: bool) -> None:
        self.starting -= 1
        if delivered:
            now = self.clock()
            took = now - start.began
            self.recent.append(took)
            self.first = took if self.first is None else self.first + 0.25 * (took - self.first)
            if self.penalty < 1 and now - max(self.backed_off, self.recovered) >= self.round:  # no late listener
                self.recovered = now
                self.penalty = min(1.0, self.penalty + 0.1)
        self._admit()

    def _admit(self) -> None:
        while self.waiting and self.starting < self.limit:
            place = self.waiting.popleft()
            if not place.done():
                self.starting += 1
                place.set_result(None)
