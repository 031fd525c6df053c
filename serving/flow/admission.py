"""Admission. ``slots`` streams generate and ``max_queue`` more may wait for a slot; a request beyond that
is refused at once as busy, whichever entry point (``tts``, ``ensemble_generator``) it came to. The two
run in separate processes, so the count lives in a shared file: one 8-byte counter per admitting model,
read and written under an exclusive ``flock``. A request holds its place from admission to its end.

The same file type counts the generator slots (``generator_slots``, serving.flow.generator_slots), whose
cap the generator sets from its step budget.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

ADMISSION = "admission"  # the admission gate's counters
ADMITTERS = ("tts", "ensemble_generator")  # one counter each, in this order
_SIZE = 8 * (len(ADMITTERS) + 1)  # the counters, then a cap below capacity that its owner may set (0: none)
_CAP = 8 * len(ADMITTERS)


class Admission:
    """A shared counter file of the folder (``admission``, ``generator_slots``). Places for ``model`` out of ``capacity`` shared with the other admitters (``model`` None: a reader
    that only asks whether the gate is full)."""

    def __init__(self, board: str | Path, model: str | None, capacity: int, file: str = ADMISSION, create: bool = True):
        """``file``: the counters' file in ``board``; ``create`` False: FileNotFoundError until a model made it."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.index, self.capacity = (None if model is None else ADMITTERS.index(model)), capacity
        self.fd = os.open(Path(board) / file, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            short = os.fstat(self.fd).st_size < _SIZE
            if short and create:
                os.ftruncate(self.fd, _SIZE)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if short and not create:
            os.close(self.fd)
            raise FileNotFoundError(f"{file} is not made yet")
        self.map = mmap.mmap(self.fd, _SIZE)

    def counts(self) -> tuple[int, ...]:
        """Requests admitted by each of :data:`ADMITTERS`."""
        return struct.unpack_from(f"<{len(ADMITTERS)}q", self.map)

    def total(self) -> int:
        return sum(self.counts())

    def full(self) -> bool:
        return self.total() >= self.limit()

    def limit(self) -> int:
        """Places now: ``capacity``, or less while a cap is set (:meth:`set_cap`)."""
        cap = int.from_bytes(self.map[_CAP : _CAP + 8], "little", signed=True)
        return min(self.capacity, cap) if cap > 0 else self.capacity

    def set_cap(self, cap: int) -> None:
        """Hold the places to ``cap`` (0: no cap) for everyone who enters from now on; those inside stay. The
        generator sets it on its ``generator_slots`` from its step budget (engine.step_cost.StepBudget)."""
        self.map[_CAP : _CAP + 8] = max(0, int(cap)).to_bytes(8, "little", signed=True)

    def enter(self) -> bool:
        """Take a place; False (nothing taken) when all ``capacity`` are held."""
        if self.index is None:
            raise ValueError("a reader of the gate takes no place")
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            counts = self.counts()
            if sum(counts) >= self.limit():
                return False
            self._write(counts[self.index] + 1)
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def leave(self) -> None:
        """Give back a place taken by :meth:`enter`."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            own = self.counts()[self.index]
            self._write(max(0, own - 1))
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def clear(self) -> None:
        """Set this model's count to 0 (at its start: a count left by a server that died is void)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            self._write(0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _write(self, count: int) -> None:
        """This model's count, copied in whole: ``struct.pack_into`` zero-fills its target first, and a
        reader without the lock (``full``, in another process) would see 0 for an instant."""
        self.map[8 * self.index : 8 * self.index + 8] = count.to_bytes(8, "little", signed=True)

    def busy_message(self) -> str:
        held = self.total()
        return f"server busy: {held} requests are running or waiting (limit {self.capacity}); retry shortly"
