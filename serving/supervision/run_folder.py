"""The launcher's run folder, the stubs' side (kept apart from the supervisor so that the stubs load only this):
heartbeats out, the launcher's flags in (docs/operations.md, Supervision and shutdown; docs/architecture.md, Flags)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from pathlib import Path

HEARTBEAT_SECONDS = 1.0  # a stub touches its heartbeat file this often
HEARTBEATS = "heartbeat"  # the run folder's subfolder of heartbeat files, <model>.<pid>
# A beat this late dumps every thread's Python stack into <run_dir>/stacks/<model>.<pid>.txt, until the file has
# STACKS_BYTES (a dump is ~100 threads' stacks at most): LateStacks; docs/operations.md, Late heartbeats.
LATE_SECONDS, STACKS, STACKS_BYTES = 2.0, "stacks", 4 << 20
SHUTTING_DOWN = "unavailable: server is shutting down"
BROKEN, DRAINING, DEAD = "broken", "draining", "dead."  # the launcher's flags: files in the run folder


def start_heartbeat(run_dir: str, model: str) -> None:
    """From a model's ``initialize`` (nothing without ``run_dir``): beat ``<run_dir>/heartbeat/<model>.<pid>``
    every second on a daemon thread (:class:`Beats`, :class:`LateStacks`), and exit the stub once its
    tritonserver is gone (an orphan stub was still there an hour later)."""
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
            with contextlib.suppress(OSError):  # the run folder is being cleaned up: keep watching the parent
                beats.beat()
            time.sleep(HEARTBEAT_SECONDS)
        os._exit(1)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


class Beats:
    """A heartbeat file: touched at every beat, its text the longest interval between two beats so far and the
    wall-clock time it ended (rewritten when it grows): ``2.680 11:31:40`` (often the stub's start)."""

    def __init__(self, path: Path, clock=time.monotonic):
        self.path, self.clock, self.last, self.longest = path, clock, None, 0.0

    def beat(self) -> None:
        now = self.clock()
        interval, self.last = (0.0 if self.last is None else now - self.last), now
        if interval > self.longest:
            self.longest = interval
            self.path.write_text(f"{interval:.3f} {time.strftime('%H:%M:%S')}\n")
        else:
            os.utime(self.path)


def longest_beat(path: Path) -> tuple[float, str] | None:
    """A heartbeat file's longest interval between two beats and when it ended (None: none yet, or no file)."""
    try:
        seconds, _, at = path.read_text().strip().partition(" ")
        return float(seconds), at
    except (OSError, ValueError):
        return None


class LateStacks:
    """faulthandler's ``dump_traceback_later`` (one timer per process), re-armed at every beat: a beat ``late`` s
    late appends every thread's stack to ``path``, up to ``cap`` bytes (docs/operations.md, Late heartbeats)."""

    def __init__(self, path: Path, late: float = LATE_SECONDS, cap: int = STACKS_BYTES):
        self.path, self.late, self.cap = path, late, cap
        self.file, self.size, self.armed = None, 0, None  # armed: when it was last armed
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")  # noqa: SIM115 - held open: the watchdog writes to its descriptor
            self.size = os.fstat(self.file.fileno()).st_size

    def arm(self) -> None:
        """No system call unless the watchdog may have dumped since the last beat (it was armed ``late``
        seconds ago or more): each one lets go of the GIL, and a beat waits to take it back."""
        if self.file is None:
            return
        now = time.monotonic()
        if self.armed is not None and now - self.armed >= 0.9 * self.late:
            with contextlib.suppress(OSError):
                if (size := os.fstat(self.file.fileno()).st_size) != self.size:  # it did: say when the next beat came
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    self.file.write(f"^ dumped: a heartbeat {self.late:g} s late; this beat at {stamp}\n\n")
                    self.file.flush()
                    size = os.fstat(self.file.fileno()).st_size
                self.size = size
            if self.size >= self.cap:
                faulthandler.cancel_dump_traceback_later()
                self.file = None
                return
        faulthandler.dump_traceback_later(self.late, file=self.file)
        self.armed = now


class RunFlags:
    """The launcher's flags, written whole (read by serving.flow.side_channel.SideChannel.flag): ``broken``,
    ``draining`` and ``dead.<model>``, each holding its message for clients (docs/architecture.md, Flags)."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)

    def set(self, name: str, message: str = SHUTTING_DOWN) -> None:
        """Raise flag ``name`` (BROKEN, DRAINING or DEAD + a model) with ``message``."""
        tmp = self.dir / f"{name}.tmp"  # written whole, then renamed: a reader never sees half a message
        tmp.write_text(message)
        tmp.replace(self.dir / name)

    def clear(self) -> None:
        for path in (self.dir / BROKEN, self.dir / DRAINING, *self.dir.glob(f"{DEAD}*")):
            path.unlink(missing_ok=True)
