"""The stubs' side of the launcher's run folder: heartbeats out, flags in.

Every model's stub beats a heartbeat file (:func:`start_heartbeat`), which the launcher's supervisor
(:mod:`serving.supervision.supervise`) watches, and reads the launcher's word to it as files (:class:`RunFlags`,
read by :meth:`serving.flow.side_channel.SideChannel.flag`). Kept apart from the supervisor so that the stubs load only this.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from pathlib import Path

HEARTBEAT_SECONDS = 1.0  # a stub touches its heartbeat file this often
HEARTBEATS = "heartbeat"  # the run folder's subfolder of heartbeat files, <model>.<pid>
# A beat this late dumps every thread's Python stack into <run_dir>/stacks/<model>.<pid>.txt, until the file has
# STACKS_BYTES (a dump is ~100 threads' stacks at most): LateStacks; docs/operations.md, Late heartbeats.
LATE_SECONDS = 2.0
STACKS = "stacks"
STACKS_BYTES = 4 << 20
SHUTTING_DOWN = "unavailable: server is shutting down"
BROKEN, DRAINING, DEAD = "broken", "draining", "dead."  # the launcher's flags: files in the run folder


def start_heartbeat(run_dir: str, model: str) -> None:
    """From a model's ``initialize``: touch ``<run_dir>/heartbeat/<model>.<pid>`` every second on a daemon
    thread, and exit the stub once its tritonserver is gone (stubs outlive it otherwise: an orphan was
    still there an hour later). Does nothing without ``run_dir`` (a plain tritonserver on model_repository/).
    The file holds the longest interval between two beats so far (:class:`Beats`); a beat LATE_SECONDS late
    dumps the stub's stacks (:class:`LateStacks`)."""
    if not run_dir:
        return
    path = Path(run_dir, HEARTBEATS, f"{model}.{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    parent = os.getppid()
    beats = Beats(path)
    late = LateStacks(Path(run_dir, STACKS, f"{model}.{os.getpid()}.txt"))

    def beat():
        while os.getppid() == parent:  # reparented: tritonserver died
            late.arm()
            try:
                beats.beat()
            except OSError:  # the run folder is being cleaned up: keep watching the parent
                pass
            time.sleep(HEARTBEAT_SECONDS)
        os._exit(1)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


class Beats:
    """A heartbeat file: touched at every beat, its text the longest interval between two beats so far (in
    seconds) and the wall-clock time it ended (rewritten only when it grows), for a soak or an operator to
    read: ``2.680 11:31:40`` (a stub's start, before the launcher watches, often has the longest)."""

    def __init__(self, path: Path, clock=time.monotonic):
        self.path, self.clock = path, clock
        self.last: float | None = None
        self.longest = 0.0

    def beat(self) -> None:
        now = self.clock()
        interval, self.last = (0.0 if self.last is None else now - self.last), now
        if interval > self.longest:
            self.longest = interval
            self.path.write_text(f"{interval:.3f} {time.strftime('%H:%M:%S')}\n")
        else:
            os.utime(self.path)


def longest_beat(path: Path) -> tuple[float, str] | None:
    """The longest interval between two beats a heartbeat file records, and when it ended (None: none yet,
    or no file)."""
    try:
        seconds, _, at = path.read_text().strip().partition(" ")
        return float(seconds), at
    except (OSError, ValueError):
        return None


class LateStacks:
    """faulthandler's ``dump_traceback_later``, re-armed at every beat: a beat ``late`` seconds late dumps every
    thread's Python stack to ``path`` (appended) from faulthandler's watchdog thread, which needs no GIL; the next
    beat adds a line saying when. One per process (faulthandler has one such timer). Stops at ``cap`` bytes."""

    def __init__(self, path: Path, late: float = LATE_SECONDS, cap: int = STACKS_BYTES):
        self.path, self.late, self.cap = path, late, cap
        self.file, self.size, self.armed = None, 0, None  # armed: when it was last armed
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")  # noqa: SIM115 - held open: the watchdog writes to its descriptor
            self.size = os.fstat(self.file.fileno()).st_size
        except OSError:
            pass

    def arm(self) -> None:
        """No system call unless the watchdog may have dumped since the last beat (it was armed ``late``
        seconds ago or more): each one lets go of the GIL, and a beat waits to take it back."""
        if self.file is None:
            return
        now = time.monotonic()
        if self.armed is not None and now - self.armed >= 0.9 * self.late:
            try:
                size = os.fstat(self.file.fileno()).st_size
                if size != self.size:  # it did: say when the next beat came
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    self.file.write(f"^ dumped: a heartbeat {self.late:g} s late; this beat at {stamp}\n\n")
                    self.file.flush()
                    size = os.fstat(self.file.fileno()).st_size
            except OSError:
                size = self.size
            self.size = size
            if size >= self.cap:
                faulthandler.cancel_dump_traceback_later()
                self.file = None
                return
        faulthandler.dump_traceback_later(self.late, file=self.file)
        self.armed = now


class RunFlags:
    """The launcher's word to the stubs, as files in the run folder, written here and read by
    :meth:`serving.flow.side_channel.SideChannel.flag`: ``broken`` holds the message for clients while a failed
    server is replaced (tts fails its running requests with it), ``draining`` the message for new requests
    while the running ones may finish (shutdown, or a restart that waits for them), ``dead.<model>`` the
    message for a request waiting on ``model`` when its stub has died (the launcher restarts the server once
    the running streams end, but that request would not get its answer before)."""

    def __init__(self, run_dir: str | Path):
        self.dir = str(run_dir)

    def set_broken(self, message: str) -> None:
        self._write(BROKEN, message)

    def set_draining(self, message: str = SHUTTING_DOWN) -> None:
        self._write(DRAINING, message)

    def set_dead(self, model: str, message: str) -> None:
        self._write(f"{DEAD}{model}", message)

    def _write(self, name: str, message: str) -> None:
        path = os.path.join(self.dir, name)
        tmp = f"{path}.tmp"  # written whole, then renamed: a reader never sees half a message
        Path(tmp).write_text(message)
        os.replace(tmp, path)

    def clear(self) -> None:
        for path in (BROKEN, DRAINING, *(p.name for p in Path(self.dir).glob(f"{DEAD}*"))):
            Path(self.dir, path).unlink(missing_ok=True)
