"""Admission, the one owner of places, generator slots (T14), their cap and waiters, and the start window, in one
shared file under one ``flock`` (T27); :class:`Place` and :class:`TextPlace`, a request's place with its gauges.
docs/architecture.md, "Admission: one owner", "Generator slots wait" and the limits table."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

from engine.protocol import Unavailable
from engine.segments import ahead_may_start
from engine.start_window import StartWindow

ADMISSION = "admission"  # the one file of every count below
ADMITTERS = ("tts", "ensemble_generator")  # one counter of each kind each, in this order
_N = len(ADMITTERS)
PLACES, SLOTS, WAITERS = 0, 8 * _N, 16 * _N  # each kind's counters' offset; WAITERS: streams waiting for a slot
_CAP = 24 * _N  # a cap on the slots that the generator sets (0: none)
_SIZE = _CAP + 8
POLL_SECONDS = 0.02  # how often the first waiter of a process looks for a free slot


class Admission:
    """The run's places (``places``: slots + max_queue), generator slots and slot waiters, as ``model`` sees them
    (one of :data:`ADMITTERS`; None: a reader: prompt_encoder, the launcher, the generator writing its cap).
    ``start_rate``: the start window's (0: none), ``share``: the processes of ``model`` (tts's instances), each with
    its share of the window; ``create`` False: FileNotFoundError until a model made the file."""

    def __init__(self, board: str | Path, model: str | None, places: int, slots: int = 1, start_rate: float = 0.0,
                 create: bool = True, share: int = 1):  # fmt: skip
        if places < 1 or slots < 1:
            raise ValueError(f"places and slots must be >= 1, got {places}, {slots}")
        self.index, self.capacity, self.slots = (None if model is None else ADMITTERS.index(model)), places, slots
        self.fd = os.open(Path(board) / ADMISSION, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        with self._locked():
            short = os.fstat(self.fd).st_size < _SIZE
            if short and create:
                os.ftruncate(self.fd, _SIZE)
        if short and not create:
            os.close(self.fd)
            raise FileNotFoundError(f"{ADMISSION} is not made yet")
        self.map = mmap.mmap(self.fd, _SIZE)
        self.starts = StartWindow.of(start_rate, share)  # this process's starts (the orchestrator asks it)
        self.turn = asyncio.Lock()  # this process's slot waiters, first come first served

    # ---- places: admission to the end of a request ----
    def counts(self, kind: int = PLACES) -> tuple[int, ...]:
        """Places (or ``kind``'s counts) held by each of :data:`ADMITTERS`."""
        return struct.unpack_from(f"<{_N}q", self.map, kind)

    def total(self) -> int:  # places held by every admitter together
        return sum(self.counts())

    def full(self) -> bool:
        return self.total() >= self.capacity

    def enter(self) -> bool:  # take a place; False (nothing taken) when all are held
        return self._take(PLACES, self.capacity)

    def leave(self) -> None:  # give back a place taken by enter
        self._add(PLACES, -1)

    def busy_message(self) -> str:
        held = self.total()
        return f"server busy: {held} requests are running or waiting (limit {self.capacity}); retry shortly"

    # ---- generator slots: from a stream's send to its end in the generator ----
    def limit(self) -> int:
        """Slots now: ``slots``, or fewer while the generator's cap is set (:meth:`set_cap`)."""
        cap = int.from_bytes(self.map[_CAP : _CAP + 8], "little", signed=True)
        return min(self.slots, cap) if cap > 0 else self.slots

    def set_cap(self, cap: int) -> None:
        """Hold the slots to ``cap`` (0: no cap) for every stream sent from now on; those inside stay. The
        generator sets it from its step budget (engine.step_cost.StepBudget)."""
        self.map[_CAP : _CAP + 8] = int64(max(0, cap))

    def slots_held(self) -> int:  # by every sender together
        return sum(self.counts(SLOTS))

    def free_slots(self) -> int:
        return max(0, self.limit() - self.slots_held())  # under the generator's cap, as try_slot

    def starts_waiting(self) -> int:  # streams waiting for a slot in every sender (read-ahead never waits)
        return sum(self.counts(WAITERS))

    def try_slot(self) -> bool:  # take a slot at once if one is free under the cap (False: nothing taken)
        return self._take(SLOTS, None)

    async def take_slot(self) -> None:
        """Wait until a slot is free and take it (cancellable: nothing is taken then). A stream that waits
        is counted in :meth:`starts_waiting` meanwhile: read-ahead segments yield it their slots."""
        if not self.turn.locked() and self.try_slot():
            return
        self._add(WAITERS, 1)
        try:
            async with self.turn:
                while not self.try_slot():
                    await asyncio.sleep(POLL_SECONDS)
        finally:
            self._add(WAITERS, -1)

    def take_ahead(self) -> bool:
        """Take a slot for a read-ahead segment, at once or never: only when one is free and no stream
        waits for one (:func:`engine.segments.ahead_may_start`). False: nothing taken."""
        return ahead_may_start(self.free_slots(), self.starts_waiting()) and self.try_slot()

    def give_slot(self) -> None:
        self._add(SLOTS, -1)

    def clear(self) -> None:
        """Set this model's slots and waiters to 0, at its start: what a server that died held is void (no
        deadlock on it). Places are the launcher's to void (a restart starts a new folder's counts)."""
        with self._locked():
            self._write(SLOTS, 0)
            self._write(WAITERS, 0)

    # ---- the file ----
    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _take(self, kind: int, limit: int | None) -> bool:
        if self.index is None:
            raise ValueError("a reader of the gate takes no place")
        with self._locked():
            counts = self.counts(kind)
            if sum(counts) >= (self.limit() if limit is None else limit):
                return False
            self._write(kind, counts[self.index] + 1)
            return True

    def _add(self, kind: int, delta: int) -> None:
        with self._locked():
            self._write(kind, max(0, self.counts(kind)[self.index] + delta))

    def _write(self, kind: int, count: int) -> None:
        at = kind + 8 * self.index
        self.map[at : at + 8] = int64(count)


def int64(value: int) -> bytes:
    """``value`` as 8 bytes, to be copied in whole: ``struct.pack_into`` zero-fills its target first, and a reader
    without a lock (another process) saw 0 for an instant (T27)."""
    return int(value).to_bytes(8, "little", signed=True)


class Place:
    """One request's admission place (taken at most once at a time; ``give`` is safe to repeat)."""

    def __init__(self, gate: Admission, count: Callable[[int, int], None]):
        # count(in_flight, waiting): add to the gauges (places held; held and no audio sent since)
        self.gate, self.count = gate, count
        self.held = self.waiting = False

    def take(self) -> bool:
        """Hold the place (True at once if held); False, nothing taken, when the gate is full."""
        if self.held:
            return True
        if not self.gate.enter():
            return False
        self.held = self.waiting = True
        self.count(1, 1)
        return True

    def audio(self) -> None:  # audio was sent: the request no longer waits (until the place is taken anew)
        if self.waiting:
            self.waiting = False
            self.count(0, -1)

    def give(self) -> None:  # the place back, if held, with what the gauges count of it
        if self.held:
            self.gate.leave()
            self.count(-1, -1 if self.waiting else 0)
            self.held = self.waiting = False


class TextPlace:
    """The place of one text-in stream: a piece with text takes it before it is queued (a full gate fails the
    stream with the busy message); it goes back once everything read is spoken and no piece with text is unread."""

    def __init__(self, place: Place):
        self.place = place
        self.unread = 0  # pieces with text queued and not yet read by the orchestrator

    def came(self, text: str) -> None:
        """A piece arrived, before it is queued: text takes the place; Unavailable (the gate's busy message,
        nothing taken) when the gate is full. Whitespace takes nothing."""
        if not text.strip():
            return
        if not self.place.take():
            raise Unavailable(self.place.gate.busy_message())
        self.unread += 1

    def read(self, text: str) -> None:  # the orchestrator read a piece (it is the orchestrator's to report on)
        if text.strip():
            self.unread -= 1

    def idle(self) -> None:
        """The orchestrator has spoken everything it read: the place goes back unless a piece with text is
        still queued (it would take it anew at once)."""
        if self.unread == 0:
            self.place.give()

    def close(self) -> None:  # the stream is over (ended, failed or cancelled): whatever it holds goes back
        self.place.give()
