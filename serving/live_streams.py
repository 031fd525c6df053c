"""Which generator streams the vocoder must accept, written by the ``generator`` and the ``vocoder``.

The vocoder is reachable by any client (it is a step of ``tts_ensemble``), and a vocoder stream holds
decoder state. So it opens a stream only for a chunk of a stream the generator issued and whose end the
vocoder has not seen yet, and when its table is full it makes room only by evicting streams that are
off this board: the table can never be filled by streams that are not owed to a consumer.

The generator marks each stream it admits as a file ``<id>`` in ``<board>/live/`` and, once the stream
ends, renames it ``ended-<id>``: its chunks are still on their way to the vocoder, however long its
consumer takes to pass them on (a backlogged ``tts`` can be seconds behind the generator, and a stream's
chunk 0 may reach the vocoder after the generator made its last chunk). The vocoder removes
``ended-<id>`` when the stream's end reaches it (:meth:`LiveStreams.claim`: its last chunk, the
ending chunk tts sends for a stream it gave up, or a chunk whose ensemble client left); the generator
removes what is still unclaimed :data:`UNCLAIMED_SECONDS` after the end, a backstop for consumers that
died. So the board holds at most the streams generating plus the streams whose consumer has not
finished them, and every consumer holds an admitted request (:mod:`serving.admission`).

One folder of small files: the generator writes only when streams start or end, the vocoder reads only
when a stream opens or its table needs room and writes once per stream, and both are cleared with the
run folder on a restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

ENDED = "ended-"
# A stream's consumer that has not passed on its end this long after the generator ended it is gone
# (its tts died); a live consumer gives it up far sooner (tts's BLS timeout, the vocoder's idle reaping).
UNCLAIMED_SECONDS = 300.0
LIVE, GONE = "live", "gone"  # states (an ended stream not yet claimed is ENDED[:-1])


class LiveStreams:
    def __init__(self, board: str | Path):
        self.dir = Path(board) / "live"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.known: set[int] = set()  # generator side: live streams written
        self.ended: dict[int, float] = {}  # generator side: ended stream -> when (monotonic), oldest first

    def _path(self, name: str | int) -> str:
        return os.path.join(self.dir, str(name))

    # ---- generator side ----
    def sync(self, live: Iterable[int], now: float | None = None) -> None:
        """Make the folder say ``live`` (the generator's streams now); cheap when nothing changed."""
        now = time.monotonic() if now is None else now
        live = set(live)
        if live != self.known:
            for stream_id in live - self.known:
                os.close(os.open(self._path(int(stream_id)), os.O_CREAT | os.O_WRONLY, 0o600))
            for stream_id in self.known - live:
                try:
                    os.replace(self._path(stream_id), self._path(f"{ENDED}{stream_id}"))
                except FileNotFoundError:
                    pass
                self.ended[stream_id] = now
            self.known = live
        while self.ended:  # insertion order is end order: only the expired are visited
            stream_id, ended_at = next(iter(self.ended.items()))
            if now - ended_at < UNCLAIMED_SECONDS:
                break
            del self.ended[stream_id]
            _remove(self._path(f"{ENDED}{stream_id}"))  # unclaimed: its consumer is gone

    def clear(self) -> None:
        for name in os.listdir(self.dir):
            _remove(self._path(name))
        self.known, self.ended = set(), {}

    # ---- vocoder side ----
    def state(self, stream_id: int) -> str:
        """``live``, ``ended`` (its end has not reached the vocoder) or ``gone``."""
        if os.path.exists(self._path(int(stream_id))):
            return LIVE
        return ENDED[:-1] if os.path.exists(self._path(f"{ENDED}{int(stream_id)}")) else GONE

    def claim(self, stream_id: int) -> None:
        """The stream's end reached the vocoder: it is gone for good (a live stream's file stays: the
        generator ends it, and its end comes later)."""
        _remove(self._path(f"{ENDED}{int(stream_id)}"))

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
