"""The run's side channel (T6, T13): :class:`SideChannel`, its one API (stream marks, the launcher's flags, the
sweep), and :class:`LiveStreams`, the live board. docs/architecture.md, "Cancellation: one carrier" and "The
live board"."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from engine.lifetime import CANCEL_POLL_SECONDS
from serving.supervision.run_folder import BROKEN, DEAD, DRAINING, SHUTTING_DOWN

KINDS = ("cancel", "lost")  # a stream's mark is the file <kind>-<id>
# Directory timestamps are coarse (a kernel tick): a listing taken within this long of the directory's
# last change may have missed a mark made in the same tick, so the next poll lists it again.
_TIMESTAMP_SLACK_NS = 50_000_000


def default_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"fireredtts3-cancel-{os.getuid()}"


class SideChannel:
    """Stream marks in the side-channel folder (``directory`` None: :func:`default_dir`) and the launcher's
    flags in its run folder (``run_dir`` empty: none are ever raised). Ids are ints: never another path."""

    def __init__(self, directory: str | Path | None = None, run_dir: str | Path = ""):
        self.dir = Path(directory) if directory else default_dir()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_dir = str(run_dir) if run_dir else ""
        self._listed_mtime, self._listed_at = -1, 0  # the latest listing: the folder's mtime then, when (ns)
        self._marks: dict[str, set[int]] = {kind: set() for kind in KINDS}  # as of the latest listing
        self._flags: dict[str, tuple[float, str | None]] = {}  # flag -> (when read, its message)
        self.live = LiveStreams(self.dir)  # live/ended streams: the generator -> the vocoder

    def _path(self, kind: str, stream_id: int) -> str:
        if kind not in KINDS:
            raise ValueError(f"no mark {kind!r}")
        return os.path.join(self.dir, f"{kind}-{int(stream_id)}")

    # ---- marks: cancel (tts, ensemble_generator, vocoder -> the generator); lost (the generator -> tts) ----
    def mark(self, kind: str, stream_id: int) -> None:
        _touch(self._path(kind, stream_id))

    def take(self, kind: str, stream_id: int) -> bool:
        """Whether the stream is marked; the mark is removed (the caller acts on it now)."""
        self._marks[kind].discard(stream_id)
        return _remove(self._path(kind, stream_id))

    unmark = take  # the mark is obsolete (the stream ended without seeing it)

    def poll(self) -> dict[str, set[int]]:
        """The marked ids of every kind: a ``stat`` of the folder, and a listing only when it changed."""
        mtime = os.stat(self.dir).st_mtime_ns
        if mtime != self._listed_mtime or self._listed_at - mtime < _TIMESTAMP_SLACK_NS:
            marks: dict[str, set[int]] = {kind: set() for kind in KINDS}
            self._listed_at = time.time_ns()
            for name in os.listdir(self.dir):
                kind, _, number = name.partition("-")
                if kind in marks and number.isdigit():
                    marks[kind].add(int(number))
            self._marks, self._listed_mtime = marks, mtime
        return self._marks

    # ---- flags: the launcher -> the stubs (serving.supervision.run_folder.RunFlags raises them) ----
    def flag(self, name: str, within: float = CANCEL_POLL_SECONDS) -> str | None:
        """The launcher's flag ``name`` (``broken``, ``draining``, ``dead.<model>``): its message, or None when
        it is down; read from its file at most once per ``within`` seconds for all who ask (0: now)."""
        now = time.monotonic()
        read_at, message = self._flags.get(name, (-math.inf, None))
        if now - read_at >= within:
            message = self._read_flag(name)
            self._flags[name] = (now, message)
        return message

    def refusal(self) -> str | None:
        """Why a new request is refused now, if it is (read now): ``broken`` wins over ``draining``."""
        return self.flag(BROKEN, 0) or self.flag(DRAINING, 0)

    def _read_flag(self, name: str) -> str | None:
        if not self.run_dir:
            return None
        try:
            with open(os.path.join(self.run_dir, name)) as f:
                message = f.read()
        except FileNotFoundError:
            return None
        if message:
            return message
        if name == BROKEN:
            return "unavailable: the server is restarting; retry shortly"
        return SHUTTING_DOWN if name == DRAINING else f"unavailable: {name[len(DEAD) :]} backend died; retry shortly"

    def sweep(self, max_age: float = 60.0) -> int:
        """Remove marks older than ``max_age`` seconds (a live stream acts on its mark within one step); the
        live board sweeps itself (:meth:`LiveStreams.sync`)."""
        cutoff, removed = time.time() - max_age, 0
        for kind, ids in self.poll().items():
            for stream_id in ids:
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path := self._path(kind, stream_id)).st_mtime < cutoff:
                        os.unlink(path)
                        removed += 1
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
    """The board of live and ended streams, ``<folder>/live/`` (docs/architecture.md, "The live board")."""

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
                _touch(self._path(int(stream_id)))
            for stream_id in self.known - live:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self._path(stream_id), self._path(f"{ENDED}{stream_id}"))
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
