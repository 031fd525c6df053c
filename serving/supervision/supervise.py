"""The launcher's supervisor of tritonserver (Triton neither restarts a dead stub nor stops reporting ready:
docs/triton.md#T15), and its watchdog process. Why and how: docs/operations.md, Supervision and shutdown."""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serving.flow.admission import Admission
from serving.supervision.run_folder import BROKEN, DEAD, DRAINING, HEARTBEATS, STACKS, RunFlags
from serving.supervision.shm import remove_segments
from serving.supervision.vitals import IN_FLIGHT, PROGRESS, STALL_SECONDS, Incident, Observation, Vitals, samples

if TYPE_CHECKING:  # the watchdog (python -m serving.supervision.supervise) stays light
    from serving.supervision.triton_env import TritonServer

POLL_SECONDS = 0.5  # the launcher checks stubs, heartbeats and progress this often
# One read of the metrics port at a poll (no answer: no progress news this poll), a 503 asked again within it:
# a poll that took over vitals.PAUSE_SECONDS would read as a pause, which starts every timer over.
METRICS_TIMEOUT = 0.5
DRAIN_SECONDS = 10.0  # running streams may finish for this long before a restart or shutdown
# Models no running stream uses (a request's first step; no stream): when one dies, the running streams finish
# first (docs/operations.md has the table); any other dead model breaks them: restart at once.
DEFERRABLE = frozenset({"prompt_encoder", "voices"})
GRACE_SECONDS = 0.3  # after raising ``broken``, tts has this long to fail its requests (it polls every 50 ms)
STOP_SECONDS = 3.0  # SIGTERM -> SIGKILL of tritonserver at shutdown
GDB_SECONDS = 20.0  # at most this long for gdb's stacks of a wedged stub, before the restart


def find_stubs(repo: Path) -> dict[int, str]:
    """pid -> model of the stubs serving ``repo`` (argv: ``triton_python_backend_stub <repo>/<model>/1/model.py``)."""
    found, prefix = {}, f"{repo}{os.sep}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # gone meanwhile
            argv = cmdline.read_bytes().split(b"\0")
            if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub") and argv[1].startswith(prefix):
                found[int(cmdline.parent.name)] = model_of(Path(os.fsdecode(argv[1])).parent.parent)
    return found


def model_of(folder: Path) -> str:
    """The model a repository folder serves, without the generator's secret suffix (serving.security.auth)."""
    return folder.name.partition("-")[0]


def is_alive(pid: int) -> bool:
    """Running or stopped; not exited (a zombie counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def say(message: str, prefix: str = "[supervisor] ") -> None:
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


@dataclass
class Supervisor:
    """Starts, restarts (a stub died, wedged or stalled), drains and stops one run's tritonserver. On the
    launcher's main thread: tritonserver's parent-death signal is tied to the thread that spawned it."""

    server: TritonServer
    run_dir: Path
    stall_seconds: float = STALL_SECONDS  # see serving.supervision.vitals; 0: no progress rule
    drain_seconds: float = DRAIN_SECONDS  # how long running streams may finish before a deferred restart
    stubs: dict[int, str] = field(default_factory=dict)  # pid -> model, noted when the server got ready

    def __post_init__(self) -> None:
        self.flags = RunFlags(self.run_dir)
        self.models = frozenset(model_of(p.parent.parent) for p in self.server.model_repository.glob("*/1/model.py"))
        self.gate: Admission | None = None  # the admission gate, read once the server has made it

    def run(self, stopping: Callable[[], bool], tick: Callable[[], None], ready: Callable[[], None]) -> None:
        """Serve until ``stopping()``, calling ``tick()`` at every check and ``ready()`` once first ready (after
        the addresses); RuntimeError when tritonserver exits before it is ready."""
        t0 = time.monotonic()
        if not self._start(stopping):
            return
        s, front = self.server, lambda on: " (the bounded front)" if on else ""
        say(f"ready in {time.monotonic() - t0:.1f} s: gRPC {s.grpc_host}:{s.ports.grpc}{front(s.grpc_front)}, "
            f"HTTP http://{s.http_host}:{s.ports.http}{front(s.http_front)}, "
            f"metrics http://{s.host}:{s.ports.metrics}/metrics")  # fmt: skip
        ready()
        while not stopping():
            tick()
            if incident := self.check():
                self.recover(incident, stopping)
            else:
                time.sleep(POLL_SECONDS)

    def _start(self, stopping: Callable[[], bool]) -> bool:
        """Start tritonserver and wait until it is ready (False: asked to stop first); note its stubs."""
        if stopping() or not self.server.start().wait_ready(math.inf, stopping):
            return False
        self.stubs = find_stubs(self.server.model_repository)
        self.vitals = Vitals(self.models, self.stall_seconds)  # a new server: nothing remembered
        self.gate = None  # a new server makes a new one
        return True

    def check(self) -> Incident | None:
        if incident := self._exited():
            return incident
        if missing := sorted(self.models - set(self.stubs.values())):
            return Incident(missing[0], "it has no stub process", True)
        incident = self.vitals.observe(self._observe())
        if self.vitals.pause:
            say(f"no check for {self.vitals.pause:.1f} s (this process or the machine was paused): "
                "heartbeat and progress timers start over")  # fmt: skip
        return incident

    def _exited(self, but: str = "") -> Incident | None:
        """tritonserver or a stub (of another model than ``but``) that has exited."""
        if self.server.proc.poll() is not None:
            return Incident("tritonserver", f"tritonserver exited with status {self.server.proc.returncode}", True)
        for pid, model in self.stubs.items():
            if model != but and not is_alive(pid):
                return Incident(model, f"its stub (pid {pid}) exited", True)
        return None

    def _observe(self) -> Observation:
        # the time of the heartbeats' look, not of the metrics read after it (up to METRICS_TIMEOUT, more
        # on a loaded machine): a file is judged by how long it stood unchanged when it was looked at
        at, beats, metrics = time.monotonic(), {}, None
        for pid, model in self.stubs.items():
            try:
                beats[pid] = os.stat(self.run_dir / HEARTBEATS / f"{model}.{pid}").st_mtime_ns
            except FileNotFoundError:
                beats[pid] = None
        if self.stall_seconds:  # no answer in time: no progress news this poll
            with contextlib.suppress(OSError, http.client.HTTPException):
                metrics = samples(self.server.metrics_text(METRICS_TIMEOUT, METRICS_TIMEOUT), PROGRESS)
        return Observation(at, dict(self.stubs), beats, metrics, self._held())

    def _held(self) -> int:
        """Admission places held now (0 before the server made its gate)."""
        if self.gate is None:
            try:
                self.gate = Admission(self.run_dir / "cancel", None, 1, create=False)
            except FileNotFoundError:
                return 0
        return self.gate.total()

    def recover(self, incident: Incident, stopping: Callable[[], bool]) -> None:
        """Fail tts's requests with the incident's message and replace the whole tritonserver; a DEFERRABLE
        dead stub lets the running streams finish first (new ones refused)."""
        t0, how = time.monotonic(), incident.how
        if incident.dead and incident.model in DEFERRABLE:
            say(f"{incident.model}: {how}; restarting tritonserver once the running streams end "
                f"(within {self.drain_seconds:g} s)")  # fmt: skip
            message = (f"unavailable: {incident.model} backend died; the server restarts once the running streams "
                       "end, retry shortly")  # fmt: skip
            self.flags.set(DEAD + incident.model, message)  # a request waiting on it is answered now
            self.flags.set(DRAINING, message)
            worse = []  # a death that breaks the running streams ends the wait

            def hurry() -> bool:
                if not worse and (found := self._exited(but=incident.model)):
                    worse.append(found)
                return stopping() or bool(worse)

            self._wait_idle(self.drain_seconds, hurry)
            if stopping():  # the launcher's shutdown drains what is left
                return
            incident = (worse or [incident])[0]
            how = incident.how if worse else f"drained in {time.monotonic() - t0:.1f} s"
        say(f"{incident.model}: {how}; restarting tritonserver")
        self.flags.set(BROKEN, incident.message)
        if not incident.dead:  # a stub's late heartbeats dumped its threads' stacks (serving.supervision.run_folder)
            for dump in sorted((self.run_dir / STACKS).glob(f"{incident.model}.*.txt")):
                say(f"{incident.model}: stacks at its late heartbeats: {dump}")
            for pid, model in self.stubs.items():  # which thread holds the GIL
                dump = self.run_dir / STACKS / f"{model}.{pid}.gdb.txt"
                if model == incident.model and f"(pid {pid})" in incident.how and native_stacks(pid, dump):
                    say(f"{model}: its native stacks: {dump}")
        if incident.model not in ("tts", "tritonserver"):  # a live tts fails its streams within 50 ms
            time.sleep(GRACE_SECONDS)
        self.stop(grace=0)  # its state is being thrown away: no graceful unload
        self.flags.clear()
        with open(self.server.log_path, "a") as log:
            log.write(f"\n[supervisor] restart: {incident.model}: {incident.how}\n\n")
        if self._start(stopping):
            say(f"{incident.model}: recovered, serving again {time.monotonic() - t0:.1f} s after detection")

    def stop(self, grace: float) -> None:
        """Stop tritonserver's process group (SIGKILL after ``grace`` s) and any stub of this run that outlived it;
        clear the heartbeats and cancellation marks."""
        self.server.stop(timeout=grace)
        kill_stubs(self.server.model_repository, 2)
        for name in (HEARTBEATS, "cancel"):
            shutil.rmtree(self.run_dir / name, ignore_errors=True)
        self.stubs = {}

    def shutdown(self, drain_seconds: float, hurry: Callable[[], bool]) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_seconds`` (less once ``hurry()``), fail
        the rest, stop. Returns within drain_seconds + about 4 s."""
        self.flags.set(DRAINING)
        self._wait_idle(drain_seconds, hurry)
        self.flags.set(BROKEN)  # the streams still running fail with this
        self._wait_idle(GRACE_SECONDS, hurry)
        self.stop(grace=STOP_SECONDS)  # with nothing in flight tritonserver exits at once, freeing its shm
        self.flags.clear()

    def _wait_idle(self, seconds: float, hurry: Callable[[], bool]) -> None:
        """Until the IN_FLIGHT gauges sum to 0 (or the metrics port refuses), at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not hurry():
            if self.server.proc is None or self.server.proc.poll() is not None:
                return
            try:
                in_flight = samples(self.server.metrics_text(1, retry_503=0), IN_FLIGHT)  # this loop asks again
                if not sum(v for by_model in in_flight.values() for v in by_model.values()):
                    return
            except (OSError, http.client.HTTPException) as e:
                if isinstance(getattr(e, "reason", e), ConnectionRefusedError):
                    return
            time.sleep(0.1)


def native_stacks(pid: int, path: Path, timeout: float = GDB_SECONDS) -> bool:
    """Append gdb's backtrace of every thread of ``pid`` to ``path`` (False without gdb): the thread holding the
    GIL is the one not in ``take_gil``, which Python's own dump (faulthandler) cannot show."""
    if (gdb := shutil.which("gdb")) is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(f"=== gdb -p {pid} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        out.flush()
        try:
            subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 40"], stdout=out,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            out.write(f"gdb: {e}\n")
    return True


def start_watchdog(repo: Path, shm_prefix: str) -> None:
    """Once this launcher is gone (even by ``kill -9``) a process of its own session kills ``repo``'s stubs and
    removes the shared memory ``shm_prefix*`` (docs/operations.md, Supervision)."""
    subprocess.Popen([sys.executable, "-m", "serving.supervision.supervise", str(os.getpid()), str(repo), shm_prefix],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def kill_stubs(repo: Path, seconds: float) -> None:
    """SIGKILL (a stopped one too) every stub serving ``repo`` until none is left, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := find_stubs(repo)) and time.monotonic() < deadline:
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        time.sleep(0.05)


if __name__ == "__main__":  # the watchdog: python -m serving.supervision.supervise LAUNCHER_PID REPO SHM_PREFIX
    while is_alive(int(sys.argv[1])):
        time.sleep(POLL_SECONDS)
    kill_stubs(Path(sys.argv[2]), 5)
    remove_segments(sys.argv[3])
