"""Pace requests between ``tts``'s instances (``--tts-instances`` N > 1): a running paced request's delivery, one
file ``pace/<token>`` in the side-channel folder (seconds taken: float64, pace requests taken: int64), made and
removed by the instance running it, counted into by any (docs/architecture.md, "tts's instances").
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from pathlib import Path

FOLDER = "pace"  # in the side-channel folder: a subfolder, so the marks' listing never sees these files
POLL_SECONDS = 0.05  # how often the owner reads its paced requests' delivery
_FILE = struct.Struct("<dq")  # seconds taken, pace requests taken
UNKNOWN, FULL = "unknown", "full"  # what deliver() may answer besides None (taken)


class PaceBoard:
    """The run's paced requests' delivery, shared by every ``tts`` instance (``directory``: the side-channel folder)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory) / FOLDER
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def open(self, token: str) -> mmap.mmap | None:
        """The delivery of a request starting here, under its ``token`` (checked: a file name); None: in use."""
        try:
            fd = os.open(self.dir / token, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return None
        try:
            os.ftruncate(fd, _FILE.size)
            return mmap.mmap(fd, _FILE.size)
        finally:
            os.close(fd)

    def close(self, token: str, shared: mmap.mmap) -> None:
        """The request is over: its token is free in every instance."""
        shared.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / token)

    def deliver(self, token: str, seconds: float, limit: int) -> str | None:
        """A pace request: ``token``'s client took ``seconds`` in all -> None (counted), :data:`UNKNOWN` (no
        running request has the token) or :data:`FULL` (it took ``limit`` pace requests already)."""
        try:
            fd = os.open(self.dir / token, os.O_RDWR)
        except FileNotFoundError:
            return UNKNOWN
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = os.pread(fd, _FILE.size, 0)
            taken, updates = _FILE.unpack(data) if len(data) == _FILE.size else (0.0, 0)
            if updates >= limit:
                return FULL
            # the seconds copied whole, after the count: the owner reads them without the lock (T27)
            os.pwrite(fd, struct.pack("<q", updates + 1), 8)
            if seconds > taken:
                os.pwrite(fd, struct.pack("<d", seconds), 0)
            return None
        finally:
            os.close(fd)  # (the lock goes with it)

    @staticmethod
    def delivered(shared: mmap.mmap) -> float:
        """The seconds a request's client took, as the board has them (read until two reads agree: a write by
        another process is a copy, not one store)."""
        while (first := shared[:8]) != shared[:8]:
            pass
        return struct.unpack("<d", first)[0]
