"""Cancellation side channel from ``tts`` to ``generator``.

Triton 2.51's Python backend cannot cancel a BLS request it started, so a cancelled client stream
would keep its generator slot until the utterance ends. Instead, ``tts`` marks the stream's id in a
private per-server directory (tmpfs where available) and the generator checks the marks of its live
streams at every step (one ``stat`` per stream), ending a marked stream within one step. The generator
removes a mark it acts on; ``tts`` removes one the stream ended without seeing; marks left behind
(a ``tts`` that timed out waiting, or died) are swept once they are a minute old.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def default_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"fireredtts3-cancel-{os.getuid()}"


class CancelBoard:
    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _path(self, stream_id: int) -> str:
        return os.path.join(self.dir, str(int(stream_id)))  # ints only: an id can never name another path

    def mark(self, stream_id: int) -> None:
        _touch(self._path(stream_id))

    def is_marked(self, stream_id: int) -> bool:
        return os.path.exists(self._path(stream_id))

    def clear(self, stream_id: int) -> None:
        _remove(self._path(stream_id))

    # The other direction: the generator gave a stream up (Triton stopped scheduling its request), and
    # tts, waiting for that stream's next chunk, ends it with an error instead of waiting for a timeout.
    def _lost_path(self, stream_id: int) -> str:
        return os.path.join(self.dir, f"lost-{int(stream_id)}")

    def mark_lost(self, stream_id: int) -> None:
        _touch(self._lost_path(stream_id))

    def consume_lost(self, stream_id: int) -> bool:
        return _remove(self._lost_path(stream_id))

    def consume(self, stream_id: int) -> bool:
        """Whether the stream is marked; the mark is removed (the caller acts on it now)."""
        return _remove(self._path(stream_id))

    def sweep(self, max_age: float = 60.0) -> int:
        """Remove marks older than ``max_age`` seconds (a live stream acts on its mark within one step)."""
        cutoff, removed = time.time() - max_age, 0
        for entry in os.scandir(self.dir):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _remove(path: str) -> bool:
    """Whether there was a file to remove."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
