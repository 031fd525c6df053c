"""One admission gate for every entry point that starts generation (``tts`` and ``ensemble_generator``).

``slots`` streams generate and ``max_queue`` more may wait for a slot; a request beyond that is refused
at once as busy, whichever model it came to. The two models run in separate processes, so the count
lives in a small shared file (in the run's private cancellation folder): one 8-byte counter per
admitting model, read and written under an exclusive ``flock``. A request holds its place from
admission to its end; a restart of the server clears the file with the run folder.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

ADMITTERS = ("tts", "ensemble_generator")  # one counter each, in this order
_FILE = "admission"
_SIZE = 8 * len(ADMITTERS)


class Admission:
    """Places for ``model`` out of ``capacity`` shared with the other admitters (``model`` None: a reader
    that only asks whether the gate is full)."""

    def __init__(self, board: str | Path, model: str | None, capacity: int, file: str = _FILE, create: bool = True):
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
        return self.total() >= self.capacity

    def enter(self) -> bool:
        """Take a place; False (nothing taken) when all ``capacity`` are held."""
        if self.index is None:
            raise ValueError("a reader of the gate takes no place")
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            counts = self.counts()
            if sum(counts) >= self.capacity:
                return False
            struct.pack_into("<q", self.map, 8 * self.index, counts[self.index] + 1)
            return True
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def leave(self) -> None:
        """Give back a place taken by :meth:`enter`."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            own = self.counts()[self.index]
            struct.pack_into("<q", self.map, 8 * self.index, max(0, own - 1))
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def clear(self) -> None:
        """Set this model's count to 0 (at its start: a count left by a server that died is void)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            struct.pack_into("<q", self.map, 8 * self.index, 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def busy_message(self) -> str:
        held = self.total()
        return f"server busy: {held} requests are running or waiting (limit {self.capacity}); retry shortly"
