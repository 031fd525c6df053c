"""Supervision of the tritonserver the launcher runs (:mod:`serving.serve`).

Triton does not restart a Python-backend stub that dies or hangs, and stays ready (docs/triton.md#T15):
a dead generator left its clients waiting 120 s for an empty error, a dead tts stub forever. So every
stub beats a heartbeat file and exits when its tritonserver is gone (stub side: :mod:`serving.supervision.run_folder`), and the launcher watches the
stub processes, the heartbeats and the models' progress on Triton's metrics port (:class:`Supervisor`;
the rules: :mod:`serving.supervision.vitals`). On an incident it fails the tts requests in flight with a message
naming the model (the ``broken`` flag, read by tts through :class:`RunFlags`), then restarts the whole
tritonserver: restarting only the failed stub would keep the generator's slots, the vocoder's stream
state and tts's BLS streams of the old one, out of step with each other (and with model-control mode
none, Triton cannot reload one model). A dead stub that no running stream uses (DEFERRABLE) lets the
running streams finish first, for up to ``drain_seconds``, while new requests are refused.
Past 300 lines on purpose: Supervisor is one state machine (poll, incident, drain, restart); its rules are
apart (vitals), tested on hand-built observations.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serving.flow.admission import Admission
from serving.supervision.run_folder import HEARTBEATS, SHUTTING_DOWN, STACKS, RunFlags
from serving.supervision.vitals import (
    EXECUTED,
    IN_FLIGHT,
    PENDING,
    STALL_SECONDS,
    STEPPED,
    Incident,
    Observation,
    Vitals,
    samples,
)

if TYPE_CHECKING:  # the stubs import this module: keep their imports light
    from serving.supervision.triton_env import TritonServer

POLL_SECONDS = 0.5  # the launcher checks stubs, heartbeats and progress this often
METRICS_TIMEOUT = 0.5  # one read of the metrics port at a poll (no answer: no progress news this poll)
DRAIN_SECONDS = 10.0  # running streams may finish for this long before a restart or shutdown
# Models no running stream uses: prompt_encoder serves a request's first step, voices no stream at all.
# When one dies, the running streams finish before the restart (new requests are refused meanwhile).
# Any other dead model (tts, generator, vocoder, ensemble_generator) breaks running streams: restart at once.
DEFERRABLE = frozenset({"prompt_encoder", "voices"})
GRACE_SECONDS = 0.3  # after raising ``broken``, tts has this long to fail its requests (it polls every 50 ms)
STOP_SECONDS = 3.0  # SIGTERM -> SIGKILL of tritonserver at shutdown
STUB = "triton_python_backend_stub"
GDB_SECONDS = 20.0  # at most this long for gdb's stacks of a wedged stub, before the restart


def find_stubs(repo: Path) -> dict[int, str]:
    """pid -> model of the stubs serving ``repo``'s models, tritonserver's children or orphans (a stub's
    command line is ``triton_python_backend_stub <repo>/<model>/1/model.py ...``)."""
    found, prefix = {}, f"{repo}{os.sep}".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(STUB.encode()) and argv[1].startswith(prefix):
            found[int(entry.name)] = model_of(Path(os.fsdecode(argv[1])).parent.parent)
    return found


def model_of(folder: Path) -> str:
    """The model a repository folder serves, as the logs and metrics name it: ``generator`` for the
    generator's folder, whose name carries the run's secret (serving.security.auth.Keys.generator_model)."""
    return folder.name.partition("-")[0]


def is_alive(pid: int) -> bool:
    """Running or stopped; not exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def say(message: str) -> None:
    print(f"[supervisor] {message}", file=sys.stderr, flush=True)


@dataclass
class Supervisor:
    """Runs tritonserver for one launcher run: starts it, restarts it after a stub dies, wedges or stalls,
    and drains and stops it. Runs on the launcher's main thread (it spawns tritonserver, whose parent-death
    signal is tied to the spawning thread)."""

    server: TritonServer
    run_dir: Path
    stall_seconds: float = STALL_SECONDS  # see serving.supervision.vitals; 0: no progress rule
    drain_seconds: float = DRAIN_SECONDS  # how long running streams may finish before a deferred restart
    stubs: dict[int, str] = field(default_factory=dict)  # pid -> model, noted when the server got ready

    def __post_init__(self) -> None:
        self.flags = RunFlags(self.run_dir)
        self.models = {model_of(p.parent.parent) for p in self.server.model_repository.glob("*/1/model.py")}
        self.vitals = Vitals(frozenset(self.models), self.stall_seconds)
        self.gate: Admission | None = None  # the admission gate, read once the server has made it

    def run(
        self, stopping: Callable[[], bool], tick: Callable[[], None] = lambda: None,
        ready: Callable[[float], None] | None = None,
    ) -> None:  # fmt: skip
        """Serve until ``stopping()``, calling ``tick()`` at every check (the launcher's own upkeep);
        RuntimeError when tritonserver exits before it is ready. ``ready(seconds)``, once tritonserver is
        first ready: the launcher's announcement (default: the addresses, with ``[supervisor] ready``)."""
        t0 = time.monotonic()
        if not self._start(stopping):
            return
        (ready or self.announce)(time.monotonic() - t0)
        while not stopping():
            tick()
            incident = self.check()
            if incident:
                self.recover(incident, stopping)
            else:
                time.sleep(POLL_SECONDS)

    def announce(self, seconds: float) -> None:
        s = self.server
        front = " (the bounded front)" if s.grpc_front else ""
        http_front = " (the bounded front)" if s.http_front else ""
        say(f"ready in {seconds:.1f} s: gRPC {s.grpc_host}:{s.ports.grpc}{front}, HTTP http://{s.http_host}:{s.ports.http}"
            f"{http_front}, "
            f"metrics http://{s.host}:{s.ports.metrics}/metrics")  # fmt: skip

    def _start(self, stopping: Callable[[], bool]) -> bool:
        """Start tritonserver and wait until it is ready (False: asked to stop first); note its stubs."""
        if stopping():
            return False
        self.server.start()
        while not self.server.is_ready():  # raises once the server has exited
            if stopping():
                return False
            time.sleep(0.25)
        self.stubs = find_stubs(self.server.model_repository)
        self.vitals.reset()
        self.gate = None  # a new server makes a new one
        return True

    def check(self) -> Incident | None:
        incident = self._exited()
        if incident:
            return incident
        missing = sorted(self.models - set(self.stubs.values()))
        if missing:
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
        at = time.monotonic()
        beats = {}
        for pid, model in self.stubs.items():
            try:
                beats[pid] = os.stat(self.run_dir / HEARTBEATS / f"{model}.{pid}").st_mtime_ns
            except FileNotFoundError:
                beats[pid] = None
        metrics = None
        if self.stall_seconds:
            try:
                metrics = samples(self.server.metrics_text(timeout=METRICS_TIMEOUT), (PENDING, EXECUTED, STEPPED))
            except (OSError, http.client.HTTPException):  # no answer in time: no progress news this poll
                pass
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
        """Fail tts's requests with the incident's message, then replace the whole tritonserver; for a dead
        stub that no running stream uses, refuse new requests and let the running ones finish first."""
        t0 = time.monotonic()
        if incident.dead and incident.model in DEFERRABLE:
            say(f"{incident.model}: {incident.how}; restarting tritonserver once the running streams end "
                f"(within {self.drain_seconds:g} s)")  # fmt: skip
            message = (f"unavailable: {incident.model} backend died; the server restarts once the running streams "
                       "end, retry shortly")  # fmt: skip
            self.flags.set_dead(incident.model, message)  # a request waiting on it is answered now
            self.flags.set_draining(message)
            worse = []  # a death that breaks the running streams ends the wait

            def hurry() -> bool:
                if not worse and (found := self._exited(but=incident.model)):
                    worse.append(found)
                return stopping() or bool(worse)

            self._wait_idle(self.drain_seconds, hurry)
            if stopping():  # the launcher's shutdown drains what is left
                return
            if worse:
                incident = worse[0]
                say(f"{incident.model}: {incident.how}; restarting tritonserver")
            else:
                say(f"{incident.model}: drained in {time.monotonic() - t0:.1f} s; restarting tritonserver")
        else:
            say(f"{incident.model}: {incident.how}; restarting tritonserver")
        if not incident.dead:  # a stub's late heartbeats dumped its threads' stacks (serving.supervision.run_folder)
            for dump in sorted((self.run_dir / STACKS).glob(f"{incident.model}.*.txt")):
                say(f"{incident.model}: stacks at its late heartbeats: {dump}")
        self.flags.set_broken(incident.message)
        if not incident.dead:  # the native stacks say which thread holds the GIL (its clients know by now)
            for pid, model in self.stubs.items():
                if model == incident.model and f"(pid {pid})" in incident.how:
                    dump = self.run_dir / STACKS / f"{model}.{pid}.gdb.txt"
                    if native_stacks(pid, dump):
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
        """Stop tritonserver's process group (SIGKILL after ``grace`` s; its shared memory goes too) and any
        stub of this run that outlived it; clear the heartbeats and cancellation marks."""
        self.server.stop(timeout=grace)
        deadline = time.monotonic() + 2
        while (left := find_stubs(self.server.model_repository)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for name in (HEARTBEATS, "cancel"):
            shutil.rmtree(self.run_dir / name, ignore_errors=True)
        self.stubs = {}

    def shutdown(self, drain_seconds: float, hurry: Callable[[], bool]) -> None:
        """Refuse new tts requests, let running ones finish for up to ``drain_seconds``, fail the rest with a
        message, then stop; skips the waits once ``hurry()``. Returns within drain_seconds + about 4 s."""
        self.flags.set_draining()
        self._wait_idle(drain_seconds, hurry)
        self.flags.set_broken(SHUTTING_DOWN)  # the streams still running fail with this
        self._wait_idle(GRACE_SECONDS, hurry)
        self.stop(grace=STOP_SECONDS)  # with nothing in flight tritonserver exits at once, freeing its shm
        self.flags.clear()

    def _wait_idle(self, seconds: float, hurry: Callable[[], bool]) -> None:
        """Until no tts or tts_ensemble request is running or waiting and no text-in stream is open (IN_FLIGHT
        sum to 0), at most ``seconds``; at once when nothing listens on the metrics port (no request can be in
        flight)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not hurry():
            if self.server.proc is None or self.server.proc.poll() is not None:
                return
            try:
                in_flight = samples(self.server.metrics_text(timeout=1), IN_FLIGHT)
                if not sum(v for by_model in in_flight.values() for v in by_model.values()):
                    return
            except (OSError, http.client.HTTPException) as e:
                if isinstance(getattr(e, "reason", e), ConnectionRefusedError):
                    return
            time.sleep(0.1)


def native_stacks(pid: int, path: Path, timeout: float = GDB_SECONDS) -> bool:
    """Append gdb's backtrace of every thread of ``pid`` to ``path`` (the thread that holds the GIL is the
    one not waiting in ``take_gil``); False without gdb. Python's own dump (faulthandler) cannot show it."""
    import subprocess

    gdb = shutil.which("gdb")
    if gdb is None:
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
    """A process in its own session that outlives the launcher: once the launcher is gone (even by
    ``kill -9``) it kills the stubs serving ``repo`` and removes the shared memory named ``shm_prefix``.
    tritonserver itself dies with the launcher (its parent-death signal); its stubs would not: their
    own parent check runs on a Python thread, which a stub shutting itself down sometimes never runs
    again (seen here: one in three launcher kills left the generator or vocoder stub behind)."""
    import subprocess

    subprocess.Popen([sys.executable, "-m", "serving.supervision.supervise", str(os.getpid()), str(repo), shm_prefix],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def watch(launcher: int, repo: Path, shm_prefix: str) -> None:
    while is_alive(launcher):
        time.sleep(POLL_SECONDS)
    deadline = time.monotonic() + 5
    while (left := find_stubs(repo)) and time.monotonic() < deadline:
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped stub too
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.1)
    for segment in Path("/dev/shm").glob(f"{shm_prefix}*"):
        segment.unlink(missing_ok=True)


if __name__ == "__main__":  # the watchdog: python -m serving.supervision.supervise LAUNCHER_PID REPO SHM_PREFIX
    watch(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
