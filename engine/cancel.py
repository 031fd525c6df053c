"""Cancellation side channel from ``tts`` to ``generator``.

Triton 2.51's Python backend cannot cancel a BLS request it started, so a cancelled client stream
would keep its generator slot until the utterance ends. Instead, ``tts`` marks the stream's
correlation id in a per-server directory (tmpfs where available) and the generator checks the marks of
its live streams at every step (one ``stat`` per stream), ending a marked stream within one step.
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
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, cid: int) -> str:
        return os.path.join(self.dir, str(int(cid)))  # ints only: an id can never name another path

    def mark(self, cid: int) -> None:
        with open(self._path(cid), "w"):
            pass

    def is_marked(self, cid: int) -> bool:
        return os.path.exists(self._path(cid))

    def clear(self, cid: int) -> None:
        try:
            os.unlink(self._path(cid))
        except FileNotFoundError:
            pass
