"""Which generator streams are live, written by the ``generator`` and read by the ``vocoder``.

The vocoder is reachable by any client (it is a step of ``tts_ensemble``), and a vocoder stream holds
decoder state. So it opens a stream only for a chunk of a stream the generator holds now, and when its
table is full it makes room only by evicting streams the generator no longer holds: the table can
never be filled by streams that are not generating. The generator marks each stream it admits as a
file ``<id>`` in ``<board>/live/`` and, once the stream ends, renames it ``ended-<id>`` for
:data:`GRACE_SECONDS` (its last chunk is on its way to the vocoder) before removing it. One folder of
small files: the generator writes only when streams start or end, the vocoder reads only when a
stream opens or its table needs room, and both are cleared with the run folder on a restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

ENDED = "ended-"
GRACE_SECONDS = 2.0  # an ended stream's last chunk reaches the vocoder in milliseconds (tts or the ensemble)
LIVE, GONE = "live", "gone"  # states (an ended stream within its grace is ENDED[:-1])


class LiveStreams:
    def __init__(self, board: str | Path):
        self.dir = Path(board) / "live"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.known: set[int] = set()  # generator side: live streams written
        self.ended: dict[int, float] = {}  # generator side: ended stream -> when (monotonic)

    def _path(self, name: str | int) -> str:
        return os.path.join(self.dir, str(name))

    # ---- generator side ----
    def sync(self, live: Iterable[int], now: float | None = None) -> None:
        """Make the folder say ``live`` (the generator's streams now); cheap when nothing changed."""
        now = time.monotonic() if now is None else now
        live = set(live)
        for stream_id in live - self.known:
            os.close(os.open(self._path(int(stream_id)), os.O_CREAT | os.O_WRONLY, 0o600))
        for stream_id in self.known - live:
            try:
                os.replace(self._path(stream_id), self._path(f"{ENDED}{stream_id}"))
            except FileNotFoundError:
                pass
            self.ended[stream_id] = now
        self.known = live
        for stream_id in [i for i, t in self.ended.items() if now - t >= GRACE_SECONDS]:
            del self.ended[stream_id]
            _remove(self._path(f"{ENDED}{stream_id}"))

    def clear(self) -> None:
        for name in os.listdir(self.dir):
            _remove(self._path(name))
        self.known, self.ended = set(), {}

    # ---- vocoder side ----
    def state(self, stream_id: int) -> str:
        """``live``, ``ended`` (within its grace) or ``gone``."""
        if os.path.exists(self._path(int(stream_id))):
            return LIVE
        return ENDED[:-1] if os.path.exists(self._path(f"{ENDED}{int(stream_id)}")) else GONE

    def snapshot(self) -> tuple[set[int], set[int]]:
        """(live ids, ended ids) in one listing."""
        live, ended = set(), set()
        for name in os.listdir(self.dir):
            if name.startswith(ENDED):
                ended.add(int(name[len(ENDED) :]))
            elif name.isdigit():
                live.add(int(name))
        return live, ended


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
