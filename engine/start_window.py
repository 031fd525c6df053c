"""Starts under load: how many utterances may be on their way to their first audio at once.

Why a window at all: a new stream's first chunks and every playing stream's next chunk share one delivery
path (the vocoder, the sends), and the generator runs a new stream far ahead of its listener. A burst of
new streams queues its chunks there in front of the next chunk of streams already playing, which then
stall. Holding a start back costs it first-audio latency, never a stall.

**Where it starts.** A window of W places, each held from a start to its first audio (about four generator
steps), admits at most W / (4 x step) starts a second, while what the delivery path can take is a rate of
starts (each puts about five chunks on it in its first seconds: engine.chunking's doubling). So the window
starts at the larger of ``least`` (32: what a fixed window measured safe on a 2-core machine) and ``rate``
times the least time to first audio of the last :data:`BASE_STARTS` starts (Little's law); ``base`` follows
the step, not the queue.

**How it moves: the way out steers it, once a lag.** Each chunk's way out (the vocoder's round trip as the
orchestrator awaits it, this process's event-loop queue included) is reported to :meth:`carried`. Once a
round (the base, at least :data:`SHORTEST_ROUND`) the least way out of the round is compared with the least of the last :data:`FLOOR_ROUNDS`
rounds: a round whose every chunk waited more than ``max(QUEUE_TARGET, floor)`` beyond that floor has a
standing queue (CoDel's test: a round's least ignores a burst, not a queue). A chunk that goes out when its
listener holds less than ``late_seconds`` (:meth:`played`) is a late listener.

- A late listener or a standing queue multiplies the window's ``gain`` by :data:`BACK_OFF`, but never below
  1, the start (on a 2-core machine with free math the way out always has a queue while every listener is
  ahead, and there a window below the start only made first audio later). Either backs off at most once a lag
  (:data:`LAG_ROUNDS` rounds) and caps growth at :data:`CEILING_SHARE` of where it backed off from for
  :data:`CEILING_SECONDS`;
- a lag without either, in which a start had to wait and the median round's least waited at most
  ``max(GROW_TARGET, floor)`` beyond the floor, multiplies the gain by :data:`GROWTH`.

The lag is the point: a start's chunks keep reaching the path for seconds after it is let in (its first four
within about 15 steps), so what the path says now answers the starts of a lag ago. A window that grew every
round (x1.1 a round, tried) let in 2.6 times what the path carried before the first answer came back, and
stalled a third of the streams at twice the path's rate. The gain stays within 1 and :data:`GAIN_MOST`, the
window within 1 and ``most`` places: at most, it gives back what it grew, so it is never smaller than the
fixed window it replaced.

- Waiting starts are admitted in arrival order, and a start that ends without audio (failed, cancelled)
  gives its place back and teaches the window nothing.

A listener is measured where the orchestrator hands its audio on: it holds what was sent minus the time
since its playback began, and one that runs dry starts again from its next chunk (the clock of
:mod:`engine.chunking`). A stream that waits for its own client is not late because of the server: a text-in
stream between turns (the orchestrator watches a listener within a segment only: :meth:`stopped` at each
segment's end), and a paced request its slow client paused (:data:`CLIENT_PAUSES`: a chunk after a pause
began or ended gets no verdict and starts the listener's clock again). Counted, one slow reader would hold
back every start's growth: each of its late chunks backs off and opens a new lag.

Plain Python on one event loop (no torch); times are seconds of ``clock``.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import statistics
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


# How many pauses its own client's pace began and ended so far, in a paced request's context (serving's tts
# sets its pacer's count); None: a request nobody paces. Both ends count: a chunk on its way as a pause began
# may come during it, and the one after the pause must get no verdict either.
CLIENT_PAUSES: contextvars.ContextVar[Callable[[], int] | None] = contextvars.ContextVar("pauses", default=None)
BASE_STARTS = 4096  # starts whose least time to first audio is the window's base
FIRST_GUESS_SECONDS = 0.25  # the base before any start has reached its first audio
FLOOR_ROUNDS = 128  # rounds whose least way out is the path's floor (about 30 s at an 80 ms step)
GROW_TARGET = 0.005  # s the median round of a lag may wait beyond the floor (or the floor, if larger) to grow
QUEUE_TARGET = 0.02  # s a round's every chunk may wait beyond the floor (or the floor itself, if larger)
SHORTEST_ROUND = 0.1  # s: a round is the base (the least time to first audio), and long enough to hear a queue
LAG_ROUNDS = 6  # rounds between two moves of the window: what the path says is the answer to a lag ago
GROWTH, BACK_OFF = 1.2, 0.7  # the gain's moves (see the module's description)
CEILING_SHARE = 0.85  # after a back-off the gain grows to this share of where it was
CEILING_SECONDS = 60.0  # for this long
GAIN_MOST = 32.0  # the gain's most (1,024 places at least 32); its least is 1, the start


class StartWindow:
    """Places for starts (see the module's description): ``gain`` times the larger of ``least`` and ``rate``
    starts a second times the base time to first audio, within 1 and ``most`` places."""

    def __init__(self, rate: float = 96.0, least: int = 32, most: int = 4096, late_seconds: float = 0.05,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if not rate > 0 or not 1 <= least <= most:
            raise ValueError(f"need rate > 0 and 1 <= least <= most, got {rate}, {least}, {most}")
        self.rate, self.least, self.most, self.late_seconds, self.clock = rate, least, most, late_seconds, clock
        self.gain = 1.0  # what the way out and late listeners made of the window
        self.starting = 0  # places held
        self.waiting: deque[asyncio.Future] = deque()  # starts waiting for a place, oldest first
        self.listeners: dict[Hashable, tuple[float, int]] = {}  # playing stream -> when its listener runs dry,
        # and its client's pauses then
        self.recent: deque[float] = deque(maxlen=BASE_STARTS)  # the latest starts' times to first audio
        self.least_first = math.inf  # their least (kept as they come: the window reads it at every start)
        self.backed_off = -float("inf")  # when the gain last backed off
        self.ceiling, self.ceiling_until = GAIN_MOST, -float("inf")  # the gain's most after a back-off, until when
        self.lag_began = clock()  # the lag's start: it grows the window if nothing said stop in it
        self.busy = 0  # the most starts holding or waiting for a place in this lag
        self.late = 0  # late chunks seen (a counter for metrics and tests)
        self.congested = 0  # rounds with a standing queue (a counter for metrics and tests)
        self.lag_ways: list[float] = []  # the lag's rounds' least ways out beyond the floor
        self.round_began = clock()
        self.least_way: float | None = None  # the round's least way out (None: no chunk carried yet)
        self.floors: deque[float] = deque(maxlen=FLOOR_ROUNDS)  # the last rounds' least ways out

    @classmethod
    def of(cls, rate: float, share: int = 1) -> StartWindow | None:
        """A window for ``rate`` starts a second; None for 0 (no window). ``share``: the processes that start
        streams on one delivery path (tts's instances), each with this share of the rate and of ``least``."""
        return cls(rate / share, least=math.ceil(32 / share)) if rate else None

    @property
    def base(self) -> float:
        return self.least_first if self.recent else FIRST_GUESS_SECONDS

    @property
    def round(self) -> float:  # how often the way out is judged (a lag is LAG_ROUNDS of it)
        return max(self.base, SHORTEST_ROUND)

    @property
    def limit(self) -> int:
        return max(1, min(self.most, math.ceil(self.gain * max(self.least, self.rate * self.base))))

    async def acquire(self) -> Start:
        """A place for one start, waiting in arrival order while the window is full (cancellable)."""
        if not self.waiting and self.starting < self.limit:
            self.starting += 1
            self.busy = max(self.busy, self.starting)
            return Start(self, self.clock())
        place = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        self.busy = max(self.busy, self.starting + len(self.waiting))
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

    def played(self, key: Hashable, seconds: float) -> None:
        """``seconds`` of stream ``key``'s audio go out now. Late if its listener held less than
        ``late_seconds``, unless a pause of its client's began or ended since its last chunk (:data:`CLIENT_PAUSES`)."""
        now, pauses = self.clock(), CLIENT_PAUSES.get()
        paused = 0 if pauses is None else pauses()
        runs_dry, seen = self.listeners.get(key, (None, paused))
        if runs_dry is not None and paused == seen and runs_dry - now < self.late_seconds:
            self.late += 1
            self._back_off(now)
        self.listeners[key] = max(now, runs_dry or now) + seconds, paused

    def carried(self, seconds: float) -> None:
        """A chunk's way out took ``seconds`` (sent to the vocoder until its audio was back); once a round the
        round's least is judged, and once a lag the window may grow (see the module's description)."""
        self.least_way = seconds if self.least_way is None else min(self.least_way, seconds)
        now = self.clock()
        if now - self.round_began < self.round:
            return
        self.floors.append(self.least_way)
        floor = min(self.floors)
        queued = self.least_way > floor + max(QUEUE_TARGET, floor)
        if queued:  # no growth, and what growth gave is given back
            self.congested += 1
            self._back_off(now)
        else:
            self.lag_ways.append(self.least_way - floor)
        if not queued and now - self.lag_began >= LAG_ROUNDS * self.round:  # a lag without a standing queue
            if self.busy > self.limit and statistics.median(self.lag_ways) <= max(GROW_TARGET, floor):
                most = self.ceiling if now < self.ceiling_until else GAIN_MOST
                self.gain = max(self.gain, min(most, self.gain * GROWTH))
                self._admit()
            self._new_lag(now)
        self.round_began, self.least_way = now, None

    def stopped(self, key: Hashable) -> None:
        """Stream ``key`` has no more audio (its end, or a wait for its client's text)."""
        self.listeners.pop(key, None)

    def _back_off(self, now: float) -> None:
        self._new_lag(now)  # no growth for a lag from now, and at most one back-off a lag
        if now - self.backed_off >= LAG_ROUNDS * self.round and self.gain > 1:
            self.backed_off, self.ceiling, self.ceiling_until = now, CEILING_SHARE * self.gain, now + CEILING_SECONDS
            self.gain = max(1.0, self.gain * BACK_OFF)

    def _new_lag(self, now: float) -> None:
        self.lag_began, self.busy, self.lag_ways = now, self.starting + len(self.waiting), []

    def _ended(self, start: Start, delivered: bool) -> None:
        self.starting -= 1
        if delivered:
            took = self.clock() - start.began
            leaves = self.recent[0] if len(self.recent) == BASE_STARTS else math.inf
            self.recent.append(took)
            self.least_first = min(self.recent) if leaves <= self.least_first else min(self.least_first, took)
        self._admit()

    def _admit(self) -> None:
        while self.waiting and self.starting < self.limit:
            place = self.waiting.popleft()
            if not place.done():
                self.starting += 1
                place.set_result(None)
