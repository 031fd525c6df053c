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
self-clocks). The default rate, 256 starts a second, is a bound on bursts, not what the delivery path
carries: that is learned (the pace, below). A fixed rate that let in more than the path carried stalled
listeners (docs/benchmarks.md, "The start window").

- **A late listener backs it off.** A playing stream whose chunk goes out when its listener holds less than
  ``late_seconds`` of audio (:meth:`played`) halves the rate part of the window (never below ``least``) and
  the pace, at
  most once a round (the smoothed time to first audio); each round with no late listener gives back a tenth
  of what was taken.
- **The CPUs pace the starts.** A start costs the way out CPU for every chunk it sends, and most of its
  chunks come in its first seconds (engine.chunking doubles a chunk's size each time, so a 48-patch stream
  sends five chunks, four of them in its first two seconds). A late listener says so only once listeners
  already stall, seconds after the starts that caused it were let in. What a chunk costs does not lag: every
  ``SAMPLE_SECONDS`` the window reads how busy the CPUs were (:class:`Busy`: the larger of this process's
  share of one core and the machine's busy share) and how many chunks went out meanwhile, and learns the
  busy share of one chunk a second (smoothed); it counts the chunks of each segment that ends (smoothed).
  Starts then go in at most at ``penalty x TARGET_BUSY / (cost of a chunk a second x chunks a segment)`` a
  second, counted over the last second. The rest of the CPUs is headroom for bursts. Until a reading has
  seen ``COST_CHUNKS`` chunks, the places alone bound the starts.
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
TARGET_BUSY = 0.7  # the busy share the starts may fill; the rest is headroom for bursts
SAMPLE_SECONDS = 0.5  # the least time between two readings of the CPUs
COST_CHUNKS = 64  # chunks a reading needs before it teaches the cost of one
LEAST_PACE = 4.0  # starts a second the CPUs always let in


class Busy:
    """How busy the CPUs that carry this process's work were since the last call, 0..1: the larger of this
    process's CPU time over one core (a Python process is one core at most for its Python work) and the
    machine's busy time over all its cores (Linux ``/proc/stat``; niced work yields to ours and is not
    counted; elsewhere the process alone)."""

    def __init__(self, stat: str = "/proc/stat", process: Callable[[], float] = time.process_time,
                 wall: Callable[[], float] = time.monotonic):  # fmt: skip
        self.stat, self.process, self.wall = stat, process, wall
        self.last = self._read()

    def _read(self) -> tuple[float, float, tuple[int, int] | None]:
        machine = None
        try:
            with open(self.stat) as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
            _user, nice, _system, idle, iowait = (ticks + [0] * 8)[:5]
            machine = (sum(ticks) - nice - idle - iowait, sum(ticks))
        except (OSError, ValueError):
            pass
        return self.wall(), self.process(), machine

    def __call__(self) -> float:
        (wall0, cpu0, machine0), (wall1, cpu1, machine1) = self.last, self._read()
        self.last = wall1, cpu1, machine1
        share = (cpu1 - cpu0) / max(wall1 - wall0, 1e-9)
        if machine0 and machine1 and machine1[1] > machine0[1]:
            share = max(share, (machine1[0] - machine0[0]) / (machine1[1] - machine0[1]))
        return min(share, 1.0)


class StartWindow:
    """Places for starts (see the module's description): ``rate`` starts a second times the base time to
    first audio, within ``least`` and ``most`` places."""

    def __init__(self, rate: float = 256.0, least: int = 32, most: int = 4096, late_seconds: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, busy: Callable[[], float] | None = None):  # fmt: skip
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
        self.busy = busy  # how busy the CPUs were since the last call (None: the CPUs cap nothing)
        self.cost: float | None = None  # busy share of one chunk a second, smoothed (None: not learned yet)
        self.per_segment = 0.0  # chunks a segment sends, smoothed (0: none ended yet)
        self.chunks = 0  # chunks sent since the last reading
        self.sent: dict[Hashable, int] = {}  # playing stream -> its chunks so far in this segment
        self.sampled = clock()  # when the CPUs were last read
        self.started: deque[float] = deque()  # when the starts of the last second were let in
        self.timer: asyncio.TimerHandle | None = None  # re-checks the pace when starts wait on it alone

    @classmethod
    def of(cls, rate: float, share: int = 1) -> StartWindow | None:
        """A window for ``rate`` starts a second; None for 0 (no window). ``share``: the processes that start
        streams on one delivery path (tts's instances), each with this share of the rate and of ``least`` (each learns
        its own pace: the machine's busy share over its own chunks)."""
        return cls(rate / share, least=math.ceil(32 / share), busy=Busy()) if rate else None

    @property
    def base(self) -> float:
        return min(self.recent) if self.recent else FIRST_GUESS_SECONDS

    @property
    def limit(self) -> int:
        return max(self.least, min(self.most, math.ceil(self.penalty * self.rate * self.base)))

    @property
    def pace(self) -> float:
        """Starts a second the CPUs carry within TARGET_BUSY (inf: not learned yet, or no reading)."""
        if not self.cost or not self.per_segment:
            return math.inf
        return max(LEAST_PACE, self.penalty * TARGET_BUSY / (self.cost * self.per_segment))

    def _room(self) -> bool:
        if self.starting >= self.limit:
            return False
        now = self.clock()
        while self.started and now - self.started[0] >= 1.0:
            self.started.popleft()
        return len(self.started) < self.pace

    @property
    def round(self) -> float:
        return FIRST_GUESS_SECONDS if self.first is None else self.first

    async def acquire(self) -> Start:
        """A place for one start, waiting in arrival order while the window is full (cancellable)."""
        self._sample()
        if not self.waiting and self._room():
            self._let_in()
            return Start(self, self.clock())
        place = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        self._admit()  # (sets the timer where only the pace holds it)
        try:
            await place
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():  # granted as it was cancelled: pass the place on
                self.starting -= 1
                if self.started:
                    self.started.pop()
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
        self.chunks += 1
        self.sent[key] = self.sent.get(key, 0) + 1
        self._sample()

    def stopped(self, key: Hashable) -> None:
        """Stream ``key`` has no more audio (its end, or a wait for its client's text)."""
        self.listeners.pop(key, None)
        sent = self.sent.pop(key, 0)
        if sent:
            self.per_segment = sent if not self.per_segment else self.per_segment + 0.05 * (sent - self.per_segment)

    def _sample(self) -> None:
        """Reads the CPUs once every SAMPLE_SECONDS and learns what a chunk a second costs."""
        now = self.clock()
        if self.busy is None or now - self.sampled < SAMPLE_SECONDS:
            return
        busy, per_second = self.busy(), self.chunks / (now - self.sampled)
        if self.chunks >= COST_CHUNKS:
            cost = busy / per_second
            self.cost = cost if self.cost is None else self.cost + 0.25 * (cost - self.cost)
        self.sampled, self.chunks = now, 0
        self._admit()

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
        while self.waiting and self._room():
            place = self.waiting.popleft()
            if not place.done():
                self._let_in()
                place.set_result(None)
        if self.waiting and self.starting < self.limit and self.timer is None and self.started:
            try:  # only the pace holds them: look again when the oldest start of the last second ages out
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self.timer = loop.call_later(max(1.0 - (self.clock() - self.started[0]), 0.001), self._timed)

    def _timed(self) -> None:
        self.timer = None
        self._admit()

    def _let_in(self) -> None:
        self.starting += 1
        self.started.append(self.clock())
