"""The run's side channel: one private folder of small files (tmpfs where available) through which the
stubs of one server tell each other about streams, where Triton has no way to (docs/triton.md#T6, #T13).
A restart of the server clears it with the run folder. :class:`SideChannel` is its one API:

============================  ==========================================  ======================================
file                          written by                                  read by
============================  ==========================================  ======================================
``cancel-<id>``               tts, ensemble_generator, vocoder            generator (once per step), removed by
                              (:meth:`~SideChannel.mark_cancelled`)       it when acted on, else by the marker
``pause-<id>``                tts (:meth:`~SideChannel.mark_paused`)      generator (the same listing), which
                                                                          skips it; removed at the stream's end
``lost-<id>``                 generator (:meth:`~SideChannel.mark_lost`)  tts waiting for that stream's chunk
``live/<id>``,                generator (:meth:`LiveStreams.sync`)        vocoder (:meth:`LiveStreams.state`),
``live/ended-<id>``                                                       which removes ``ended-`` (``claim``)
``admission``                 tts, ensemble_generator (places, generator  every admitter, prompt_encoder, the
                              slots and their waiters), the generator     launcher (leaks: serving.supervision.vitals)
                              (its slot cap): serving.flow.admission
``receipts-<sender>``         tts, ensemble_generator                     generator, before it sends a stream's
                              (serving.flow.receipts: responses read)     next response (docs/triton.md#T23)
============================  ==========================================  ======================================

Cancellation. Triton cannot cancel a BLS request or a running ensemble step (docs/triton.md#T6), so a
stream whose client left would keep its generator slot until the utterance ends. Instead its id is marked:
``tts`` marks the streams of a cancelled request, ``ensemble_generator`` those of a cancelled direct caller,
and the ``vocoder`` a ``tts_ensemble`` stream whose client left (Triton hands the vocoder that stream's later
chunks already cancelled). The generator reads the marks once per step (one ``stat`` of the folder, a
listing only when it changed) and ends a marked stream within one step. The generator removes a mark it
acts on; the marker removes one the stream ended without seeing; marks left behind are swept
(:meth:`SideChannel.sweep`) once they are a minute old. The other direction, ``lost``: the generator gave
a stream up (its responses could not be sent), and tts, waiting for that stream's next chunk, ends it
with an error instead of waiting for a timeout.

Pausing. A request whose client is far behind what it was sent (serving.flow.pacing) has its streams
marked ``pause-<id>``; the generator reads those marks in the same one listing per step as the cancel marks
and does not step a paused stream (it keeps its slot and pages) until tts removes the mark. The generator
removes a stream's pause mark when the stream ends, and tts when its request ends; the sweep removes a
pause mark only once it is a minute old and its stream is not on the live board.

Live streams. The vocoder is reachable by any client (it is a step of ``tts_ensemble``), and a vocoder
stream holds decoder state. So it opens a stream only for a chunk of a stream the generator issued and
whose end the vocoder has not seen yet, and when its table is full it makes room only by evicting streams
that are off this board: the table can never be filled by streams that are not owed to a consumer. The
generator marks each stream it admits as a file ``live/<id>`` and, once the stream ends, renames it
``ended-<id>``: its chunks are still on their way to the vocoder, however long its consumer takes to
pass them on (a backlogged ``tts`` can be seconds behind the generator, and a stream's chunk 0 may reach
the vocoder after the generator made its last chunk). The vocoder removes ``ended-<id>`` when the
stream's end reaches it (its last chunk, the ending chunk tts sends for a stream it gave up, or a chunk
whose ensemble client left); the generator removes what is still unclaimed :data:`UNCLAIMED_SECONDS`
after the end, a backstop for consumers that died. So the board holds at most the streams generating
plus the streams whose consumer has not finished them, and every consumer holds an admitted request.
The generator writes only when streams start or end, the vocoder reads only when a stream opens or its
table needs room and writes once per stream.

One file rather than three modules: the folder, its sweep and its file helpers are one subject, and
every stub that uses one part opens the same folder (~280 lines, most of them this description).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

CANCEL, LOST, PAUSE = "cancel-", "lost-", "pause-"
# Directory timestamps are coarse (a kernel tick): a listing taken within this long of the directory's
# last change may have missed a mark made in the same tick, so the next check lists it again.
_TIMESTAMP_SLACK_NS = 50_000_000


def default_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"fireredtts3-cancel-{os.getuid()}"


class SideChannel:
    """The run's side-channel folder, as one process sees it (``directory`` None: :func:`default_dir`).
    Stream ids are ints only: an id never names another path."""

    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory) if directory else default_dir()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._listed_mtime: int | None = None
        self._marked: set[int] = set()
        self._paused: set[int] = set()
        self.live = LiveStreams(self.dir)  # live/ended streams: the generator -> the vocoder

    def _path(self, prefix: str, stream_id: int) -> str:
        return os.path.join(self.dir, f"{prefix}{int(stream_id)}")

    # ---- cancelled: tts, ensemble_generator, vocoder -> the generator ----
    def mark_cancelled(self, stream_id: int) -> None:
        """The stream's caller left: the generator ends it at its next step."""
        _touch(self._path(CANCEL, stream_id))

    def is_cancelled(self, stream_id: int) -> bool:
        return os.path.exists(self._path(CANCEL, stream_id))

    def unmark_cancelled(self, stream_id: int) -> None:
        """The stream ended without seeing its mark: the mark is obsolete."""
        _remove(self._path(CANCEL, stream_id))

    def take_cancelled(self, stream_id: int) -> bool:
        """Whether the stream is marked; the mark is removed (the caller acts on it now)."""
        self._marked.discard(stream_id)
        return _remove(self._path(CANCEL, stream_id))

    def cancelled(self) -> set[int]:
        """The ids marked cancelled: a ``stat`` of the folder, and a listing only when it changed (the
        generator asks once per step, for all its streams; :meth:`paused` answers from the same listing)."""
        mtime = os.stat(self.dir).st_mtime_ns
        if mtime != self._listed_mtime or time.time_ns() - mtime < _TIMESTAMP_SLACK_NS:
            cancelled, paused = set(), set()
            for name in os.listdir(self.dir):
                if name.startswith(CANCEL):
                    cancelled.add(int(name[len(CANCEL) :]))
                elif name.startswith(PAUSE):
                    paused.add(int(name[len(PAUSE) :]))
            self._marked, self._paused, self._listed_mtime = cancelled, paused, mtime
        return self._marked

    # ---- paused: tts -> the generator ----
    def mark_paused(self, stream_id: int) -> None:
        """The stream's client is far behind: the generator does not step it until :meth:`unmark_paused`."""
        _touch(self._path(PAUSE, stream_id))

    def unmark_paused(self, stream_id: int) -> None:
        """The stream may step again (or it ended)."""
        _remove(self._path(PAUSE, stream_id))

    def paused(self) -> set[int]:
        """The ids marked paused as of the latest :meth:`cancelled` (one listing for both)."""
        return self._paused

    # ---- lost: the generator -> tts ----
    def mark_lost(self, stream_id: int) -> None:
        """The generator gave the stream up (its responses could not be sent)."""
        _touch(self._path(LOST, stream_id))

    def take_lost(self, stream_id: int) -> bool:
        """Whether the stream was lost; the mark is removed."""
        return _remove(self._path(LOST, stream_id))

    def lost(self) -> set[int]:
        """The ids marked lost now (one listing: a reader of many streams asks once for all of them)."""
        return {int(n[len(LOST) :]) for n in os.listdir(self.dir) if n.startswith(LOST)}

    def sweep(self, max_age: float = 60.0) -> int:
        """Remove cancelled and lost marks older than ``max_age`` seconds (a live stream acts on its mark
        within one step), and pause marks as old whose stream is not live; the live board sweeps itself
        (:meth:`LiveStreams.sync`)."""
        cutoff, removed = time.time() - max_age, 0
        for entry in os.scandir(self.dir):
            if entry.name.startswith(PAUSE):  # a paused stream may wait long: only one no longer live goes
                if self.live.state(int(entry.name[len(PAUSE) :])) == LIVE:
                    continue
            elif not entry.name.startswith((CANCEL, LOST)):
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


ENDED = "ended-"
# A stream's consumer that has not passed on its end this long after the generator ended it is gone
# (its tts died); a live consumer gives it up far sooner (tts's BLS timeout, the vocoder's idle reaping).
UNCLAIMED_SECONDS = 300.0
LIVE, GONE = "live", "gone"  # states (an ended stream not yet claimed is ENDED[:-1])


class LiveStreams:
    """The board of live and ended streams, ``<folder>/live/`` (see the module's description)."""

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
