"""Cancellation side channel to the ``generator``, from ``tts``, ``ensemble_generator`` and the ``vocoder``.

Triton cannot cancel a BLS request or a running ensemble step (docs/triton.md#T6), so a stream whose
client left would keep its generator slot until the utterance ends. Instead the stream's id is marked in a private
per-server directory (tmpfs where available): ``tts`` marks the streams of a cancelled request,
``ensemble_generator`` those of a cancelled direct caller, and the ``vocoder`` a ``tts_ensemble`` stream
whose client left (Triton hands the vocoder that stream's later chunks already cancelled). The
generator reads the marks once per step (one ``stat`` of the directory, a listing only when it
changed) and ends a marked stream within one step. The generator removes a mark it acts on; the marker
removes one the stream ended without seeing; marks left behind are swept once they are a minute old.

Other files in the same directory belong to :mod:`serving.live_streams` and :mod:`serving.admission`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

CANCEL, LOST = "cancel-", "lost-"
# Directory timestamps are coarse (a kernel tick): a listing taken within this long of the directory's
# last change may have missed a mark made in the same tick, so the next check lists it again.
_TIMESTAMP_SLACK_NS = 50_000_000


def default_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"fireredtts3-cancel-{os.getuid()}"


class CancelBoard:
    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._listed_mtime: int | None = None
        self._marked: set[int] = set()

    def _path(self, stream_id: int) -> str:
        return os.path.join(self.dir, f"{CANCEL}{int(stream_id)}")  # ints only: an id never names another path

    def mark(self, stream_id: int) -> None:
        _touch(self._path(stream_id))

    def is_marked(self, stream_id: int) -> bool:
        return os.path.exists(self._path(stream_id))

    def clear(self, stream_id: int) -> None:
        _remove(self._path(stream_id))

    def consume(self, stream_id: int) -> bool:
        """Whether the stream is marked; the mark is removed (the caller acts on it now)."""
        self._marked.discard(stream_id)
        return _remove(self._path(stream_id))

    def marked(self) -> set[int]:
        """The ids marked for cancellation: a ``stat`` of the directory, and a listing only when it changed
        (the generator asks once per step, for all its streams)."""
        mtime = os.stat(self.dir).st_mtime_ns
        if mtime != self._listed_mtime or time.time_ns() - mtime < _TIMESTAMP_SLACK_NS:
            self._marked = {int(n[len(CANCEL) :]) for n in os.listdir(self.dir) if n.startswith(CANCEL)}
            self._listed_mtime = mtime
        return self._marked

    # The other direction: the generator gave a stream up (Triton stopped scheduling its request), and
    # tts, waiting for that stream's next chunk, ends it with an error instead of waiting for a timeout.
    def _lost_path(self, stream_id: int) -> str:
        return os.path.join(self.dir, f"{LOST}{int(stream_id)}")

    def mark_lost(self, stream_id: int) -> None:
        _touch(self._lost_path(stream_id))

    def consume_lost(self, stream_id: int) -> bool:
        return _remove(self._lost_path(stream_id))

    def sweep(self, max_age: float = 60.0) -> int:
        """Remove marks older than ``max_age`` seconds (a live stream acts on its mark within one step)."""
        cutoff, removed = time.time() - max_age, 0
        for entry in os.scandir(self.dir):
            if not entry.name.startswith((CANCEL, LOST)):
                continue
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
