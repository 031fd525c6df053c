"""The stubs' side of the launcher's run folder: heartbeats out, flags in.

Every model's stub beats a heartbeat file (:func:`start_heartbeat`), which the launcher's supervisor
(:mod:`serving.supervise`) watches, and reads the launcher's word to it as files (:class:`RunFlags`).
Kept apart from the supervisor so that the stubs load only this.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

HEARTBEAT_SECONDS = 1.0  # a stub touches its heartbeat file this often
HEARTBEATS = "heartbeat"  # the run folder's subfolder of heartbeat files, <model>.<pid>
SHUTTING_DOWN = "unavailable: server is shutting down"


def start_heartbeat(run_dir: str, model: str) -> None:
    """From a model's ``initialize``: touch ``<run_dir>/heartbeat/<model>.<pid>`` every second on a daemon
    thread, and exit the stub once its tritonserver is gone (stubs outlive it otherwise: an orphan was
    still there an hour later). Does nothing without ``run_dir`` (a plain tritonserver on model_repository/)."""
    if not run_dir:
        return
    path = Path(run_dir, HEARTBEATS, f"{model}.{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    parent = os.getppid()

    def beat():
        while os.getppid() == parent:  # reparented: tritonserver died
            try:
                path.touch()
            except OSError:  # the run folder is being cleaned up: keep watching the parent
                pass
            time.sleep(HEARTBEAT_SECONDS)
        os._exit(1)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


class RunFlags:
    """The launcher's word to tts, as files in the run folder (one syscall per check: tts checks every
    50 ms per request): ``broken`` holds the message for clients while a failed server is replaced (tts
    fails its running requests with it), ``draining`` the message for new requests while the running ones
    may finish (shutdown, or a restart that waits for them)."""

    def __init__(self, run_dir: str | Path):
        self.dir = str(run_dir) if run_dir else ""
        self._broken, self._draining = os.path.join(self.dir, "broken"), os.path.join(self.dir, "draining")

    def broken(self) -> str | None:
        if not self.dir:
            return None
        try:
            with open(self._broken) as f:
                return f.read() or "unavailable: the server is restarting; retry shortly"
        except FileNotFoundError:
            return None

    def draining(self) -> str | None:
        if not self.dir:
            return None
        try:
            with open(self._draining) as f:
                return f.read() or SHUTTING_DOWN
        except FileNotFoundError:
            return None

    def dead(self, model: str) -> str | None:
        """The message for a request waiting on ``model`` when its stub has died (the launcher restarts the
        server once the running streams end, but that request would not get its answer before)."""
        if not self.dir:
            return None
        try:
            with open(os.path.join(self.dir, f"dead.{model}")) as f:
                return f.read() or f"unavailable: {model} backend died; retry shortly"
        except FileNotFoundError:
            return None

    def set_dead(self, model: str, message: str) -> None:
        self._write(os.path.join(self.dir, f"dead.{model}"), message)

    def refusal(self) -> str | None:
        """Why a new request is refused now, if it is."""
        return self.broken() or self.draining()

    def set_broken(self, message: str) -> None:
        self._write(self._broken, message)

    def set_draining(self, message: str = SHUTTING_DOWN) -> None:
        self._write(self._draining, message)

    @staticmethod
    def _write(path: str, message: str) -> None:
        tmp = f"{path}.tmp"  # written whole, then renamed: a reader never sees half a message
        Path(tmp).write_text(message)
        os.replace(tmp, path)

    def clear(self) -> None:
        for path in (self._broken, self._draining, *Path(self.dir).glob("dead.*")):
            Path(path).unlink(missing_ok=True)
