"""When a stream's gathered patches become an audio chunk: a deadline rule over plain numbers (no torch).

A listener plays the first chunk as soon as it arrives and has nothing else buffered. With a fixed
schedule c0, c1, ... and each patch (160 ms of audio) made in r x 160 ms, chunk k arrives in time iff
``r (c1 + ... + ck) <= c0 + ... + c(k-1)``: for every r < 1 that needs ck <= c0, and a schedule that
grows by g keeps up only while r <= 1/g. (3, 12) needs r <= 1/4. So a stream does not follow a fixed
schedule: :class:`ChunkClock` keeps what the listener holds (audio sent minus the wall time since the
first chunk left, as if playback began the moment it left) and cuts the gathered patches into a chunk

- when they reach :attr:`ChunkClock.largest`: as many patches as the listener was sent so far (at least
  ``first``, at most ``cap``), so that the audio sent at most doubles with each chunk (3, 3, 6, 12, 24
  patches while generation runs ahead), or
- when waiting one more step could leave the listener with less than :attr:`Margin.seconds`: the next
  step, a step by which a chunk may lag behind its step (a spare since serving.stub.generator_host sends a
  chunk as soon as its step ends), one step of jitter, and a floor for the vocoder and transport.

Guarantee: a stream whose generation keeps up (every step shorter than the 160 ms of audio it adds,
r < 1, and within 1.5 times the running estimate of a step) and whose chunks reach the client within
one step plus :attr:`Margin.floor` of being cut never underruns with the first chunk as its only
buffer, if that first chunk covers two steps and the floor (3 patches: 480 ms > 2 x 160 ms + 100 ms).
Why: a stream that does not cut still holds 3 step estimates + floor, so it can wait out the next step
(at most 1.5 estimates) and still cut in time for the chunk's delivery (the step after, at most 1.5
estimates, + floor); one that cuts on consecutive steps adds at least 160 ms per step that took less.

Why the doubling, when ``cap`` at once would mean fewer chunks: a chunk's delivery (vocoder, transport,
the client) takes time in proportion to its audio, and the time it has is what the listener holds. A
second chunk of 24 patches after a first of 3 must move 8 times the audio the listener holds before that
runs out; when many streams start together it did not (`python -m bench.ceiling` with the generator
pipe, which lets generation run far ahead: a ceiling of 128-192 streams on a 2-core machine, every failure
at a second chunk; with the doubling, 224-448). A chunk no larger than what was sent keeps that
ratio at 1 and costs a stream about log2(cap / first) more chunks, once.

A stream that cannot keep up (its step estimate is 160 ms or more) or whose listener ran dry cuts at
``first`` patches, as a fresh start, instead of one patch per step: a chunk costs the front door about
2 ms of CPU whatever its size, so small chunks would make an overloaded server slower still. Its
listener hears stalls either way; after running dry the clock restarts at the re-buffering chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

PATCH_SECONDS = 0.16  # audio in one patch (engine.config.PATCH_SAMPLES at 24 kHz)


@dataclass(frozen=True)
class ChunkSchedule:
    """How a stream's chunks are sized (the request parameters chunk_first, chunk_next, chunk_fixed)."""

    first: int  # patches in the first chunk, and in a chunk that re-buffers a listener who ran dry
    cap: int  # most patches in a later chunk (chunk_next)
    fixed: bool = False  # True: first, then cap each, whatever the timing (the schedule before issue 26)
    buffered: float = 0.0  # seconds of audio the listener holds when the stream starts (a later text segment)

    def __post_init__(self) -> None:
        if self.first < 1 or self.cap < 1:
            raise ValueError(f"chunk schedule must be positive patch counts, got {self.first}, {self.cap}")
        if not 0.0 <= self.buffered < float("inf"):
            raise ValueError(f"buffered must be a finite number of seconds >= 0, got {self.buffered}")


@dataclass(frozen=True)
class Margin:
    """What the listener must still hold after a step for the stream to wait one more step (seconds)."""

    steps: float = 3.0  # step estimates: the next step, a chunk's lag of one step, one step of jitter
    # seconds: the vocoder, the BLS hops and the client's transport, which do not scale with the step (a
    # BLS hop is ~0.5 ms, a 12-patch vocoder call a few ms on a GPU; the rest is room for a busy tts)
    floor: float = 0.1
    smoothing: float = 0.25  # weight of the newest step in the running estimate

    def __post_init__(self) -> None:
        if self.steps < 2 or self.floor < 0 or not 0 < self.smoothing <= 1:
            raise ValueError(f"need steps >= 2, floor >= 0 and smoothing in (0, 1], got {self}")

    def seconds(self, step: float) -> float:
        return self.steps * step + self.floor


MARGIN = Margin()


class ChunkClock:
    """One stream's chunk decisions. Times are seconds of one monotonic clock, given by the caller.

    Call :meth:`due` after every step of the stream with the patches gathered so far (maybe 0); when
    it answers True the caller cuts all of them into a chunk. The stream's last chunk is the caller's
    business (it is cut whatever this says).
    """

    def __init__(self, schedule: ChunkSchedule, now: float, margin: Margin = MARGIN):
        self.schedule, self.margin = schedule, margin
        self.last = now  # end of the stream's previous step (its admission, before the first)
        self.steps = 0  # steps seen
        self.took = 0.0  # wall time of the latest step, seconds
        # running estimate of a step's wall time, seconds; None until the second step (the first
        # includes the prefill and any wait for a slot)
        self.step: float | None = None
        self.chunks = 0  # chunks cut
        # the listener: `sent` seconds of audio handed over since `origin`; origin None: not playing
        self.origin: float | None = now if schedule.buffered > 0 else None
        self.sent = schedule.buffered

    def rest(self, now: float) -> None:
        """The stream was not stepped in the step that ended at ``now`` (paused: its client is behind,
        serving.flow.pacing): that wait is no step of its, so it does not enter :attr:`step`."""
        self.last = now

    def left(self, now: float) -> float:
        """Seconds of audio the listener still holds at ``now`` (0 before the first chunk)."""
        return 0.0 if self.origin is None else self.sent - (now - self.origin)

    def due(self, pending: int, now: float) -> bool:
        """After a step that ended at ``now`` with ``pending`` patches gathered: cut them into a chunk
        now? Records the cut when it answers True."""
        self._timed(now)
        if pending < 1:
            return False
        s = self.schedule
        if s.fixed:
            cut = pending >= (s.first if self.chunks == 0 else s.cap)
        elif self.origin is None or self.left(now) <= 0:  # a fresh start, or a listener who ran dry
            cut = pending >= s.first
        elif pending >= self.largest:
            cut = True
        elif self.left(now) < self.margin.seconds(max(self.took, self.step or 0.0)):
            # deadline: at once, unless this stream cannot keep up (it would only spray small chunks)
            cut = self.keeping_up or pending >= s.first
        else:
            cut = False
        if cut:
            self._cut(pending, now)
        return cut

    @property
    def largest(self) -> int:
        """The most patches a later chunk holds now: as many as the listener was sent since playback
        (re)started, at least ``first``, at most ``cap``: the audio sent doubles at most with each chunk."""
        return min(self.schedule.cap, max(self.schedule.first, round(self.sent / PATCH_SECONDS)))

    @property
    def keeping_up(self) -> bool:
        """Whether the running estimate of a step is under the 160 ms of audio it adds (r < 1)."""
        return self.step is None or self.step < PATCH_SECONDS

    def _timed(self, now: float) -> None:
        self.took, self.last, self.steps = now - self.last, now, self.steps + 1
        if self.steps > 1:
            a = self.margin.smoothing
            self.step = self.took if self.step is None else (1 - a) * self.step + a * self.took

    def _cut(self, patches: int, now: float) -> None:
        if self.origin is None or self.left(now) <= 0:  # playback (re)starts with this chunk
            self.origin, self.sent = now, 0.0
        self.sent += patches * PATCH_SECONDS
        self.chunks += 1
