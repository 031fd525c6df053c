"""Cancellation side channel from ``tts`` to ``generator``.

Triton 2.51's Python backend cannot cancel a BLS request it started, so a cancelled client stream
would keep its generator slot until the utterance ends. Instead, ``tts`` marks the stream's id in a
private per-server directory (tmpfs where available) and the generator checks the marks of its live
streams at every step (one ``stat`` per stream), ending a marked stream within one step. The generator
removes a mark it acts on; ``tts`` removes one the stream ended without seeing.
"""

from __future__ import annotations

import os
import tempfile
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
        fd = os.open(self._path(stream_id), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)

    def is_marked(self, stream_id: int) -> bool:
        return os.path.exists(self._path(stream_id))

    def clear(self, stream_id: int) -> None:
        try:
            os.unlink(self._path(stream_id))
        except FileNotFoundError:
            pass

    def consume(self, stream_id: int) -> bool:
        """Whether the stream is marked; the mark is removed (the caller acts on it now)."""
        if not self.is_marked(stream_id):
            return False
        self.clear(stream_id)
        return True
