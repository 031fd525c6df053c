"""The real launcher (``python -m serving.serve``) on free ports, for the launcher and supervision tests,
and helpers that watch it from outside: a stream on its own thread (a held one too), a readiness poller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from client import TTSClient
from serving.supervision.supervise import find_stubs, is_alive
from serving.supervision.triton_env import READY_TIMEOUT, REPO_ROOT, Ports, free_port


def children(pid: int, name: str) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=,comm=", "--ppid", str(pid)], check=False, capture_output=True, text=True
    ).stdout
    return [int(p) for p, comm in (line.split(None, 1) for line in out.splitlines()) if comm.strip() == name]


@dataclass
class Launcher:
    """One ``python -m serving.serve``; its output goes to ``output``. As a context manager it is always
    killed afterwards, with its tritonserver, stubs and shared memory, whatever the test did."""

    proc: subprocess.Popen
    ports: Ports
    output: Path
    openai: int  # the gateway's port

    @classmethod
    def start(cls, ckpt: Path, tmp: Path, *args: str, ports: Ports | None = None) -> Launcher:
        ports, openai = ports or Ports.free(), free_port()
        cmd = [
            sys.executable, "-m", "serving.serve", "--checkpoint", str(ckpt), "--voice-dir", str(tmp / "voices"),
            "--work-dir", str(tmp / "runs"), "--state-dir", str(tmp / "state"), "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
            "--metrics-port", str(ports.metrics), "--openai-port", str(openai), *args,
        ]  # fmt: skip
        output = tmp / f"launcher-{time.monotonic_ns()}.txt"
        with open(output, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        return cls(proc, ports, output, openai)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    @property
    def run_dir(self) -> Path:
        for line in self.text().splitlines():
            if line.startswith("run folder: "):
                return Path(line.removeprefix("run folder: "))
        raise AssertionError(f"the launcher printed no run folder:\n{self.text()}")

    @property
    def shm_prefix(self) -> str:
        return f"tts{self.proc.pid}_{self.ports.grpc}_"

    def ready_status(self) -> int:
        """HTTP status of the readiness probe; 0 when nothing answers."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.http}/v2/health/ready", timeout=1) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def first_start(self) -> float:
        """Seconds its first tritonserver took to get ready, as the launcher measured and printed them
        (``[supervisor] ready in X s``): what a restart costs on this machine, at its load now."""
        for line in self.text().splitlines():
            if line.startswith("[supervisor] ready in "):
                return float(line.removeprefix("[supervisor] ready in ").partition(" s")[0])
        raise AssertionError(f"the launcher did not say how long its start took:\n{self.text()}")

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.ready_status() != 200:
            assert self.proc.poll() is None, f"the launcher exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"not ready in {timeout:.0f} s:\n{self.text()}"
            time.sleep(0.25)

    def servers(self) -> list[int]:
        return children(self.proc.pid, "tritonserver")

    def stubs(self) -> dict[str, int]:
        """model -> pid of this run's stubs."""
        return {model: pid for pid, model in find_stubs(self.run_dir / "model_repository").items()}

    def client(self, **kw) -> TTSClient:
        return TTSClient(f"127.0.0.1:{self.ports.grpc}", **kw)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines) if name[:4] == "tts_"}

    def kill(self) -> None:
        """SIGKILL the launcher, then whatever of its run is left (nothing, if it cleans up after itself)."""
        servers = self.servers() if self.proc.poll() is None else []
        repo = self.run_dir / "model_repository" if "run folder: " in self.text() else None
        self.proc.kill()
        self.proc.wait(10)
        for pid in servers:
            with_pid(os.killpg, pid, signal.SIGKILL)
        for pid in find_stubs(repo) if repo else {}:
            with_pid(os.kill, pid, signal.SIGCONT)
            with_pid(os.kill, pid, signal.SIGKILL)
        for seg in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            seg.unlink(missing_ok=True)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def with_pid(fn, *args) -> None:
    try:
        fn(*args)
    except ProcessLookupError:
        pass


def gone(pids, timeout: float) -> bool:
    """Whether every pid has exited (zombies count) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@dataclass
class Stream:
    """One tts stream on its own thread: ``started`` is set at its first chunk; then ``error`` (None:
    finished) and ``ended`` (monotonic time) once it is over. ``times``: when each chunk came (monotonic)."""

    client: TTSClient
    text: str
    parameters: dict
    kw: dict = field(default_factory=dict)
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    chunks: int = 0
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    ended: float = 0.0

    def __post_init__(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for _ in self.client.stream(self.text, parameters=self.parameters, **self.kw):
                self.times.append(time.monotonic())
                self.chunks += 1
                self.started.set()
        except Exception as e:  # the test looks at it
            self.error = e
        self.ended = time.monotonic()
        self.started.set()
        self.done.set()


class HeldStream:
    """A text-in stream through the gRPC front, on a thread, whose text does not end until ``release`` is
    set: it runs for as long as the test wants, whatever the checkpoint's pace. Its first piece is spoken
    at once; ``after``, if given, is the text sent once released. ``started``: its first chunk came;
    ``chunks``: how many came; ``done``: it ended, with ``error`` (None: it finished)."""

    def __init__(self, launcher: Launcher, after: str = ""):
        self.release, self.started, self.done = threading.Event(), threading.Event(), threading.Event()
        self.after = after
        self.chunks = 0
        self.error: BaseException | None = None
        self.ended = 0.0
        threading.Thread(target=self._run, args=(launcher.client(timeout=60),), daemon=True).start()

    def _pieces(self):
        yield "A stream that is still running. "
        self.release.wait(120)
        if self.after:
            yield self.after

    def _run(self, client) -> None:
        try:
            for _ in client.stream_text(self._pieces(), flush=True, seed=1, parameters={"max_patches": 4}):
                self.chunks += 1
                self.started.set()
        except Exception as e:  # the test looks at it
            self.error = e
        self.ended = time.monotonic()
        self.done.set()


class ReadyWatch:
    """Polls readiness every 0.1 s on a thread; ``statuses`` is [(monotonic time, HTTP status or 0)]."""

    def __init__(self, launcher: Launcher):
        self.statuses: list[tuple[float, int]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(launcher,), daemon=True)
        self.thread.start()

    def _run(self, launcher: Launcher) -> None:
        while not self.stopped.is_set():
            self.statuses.append((time.monotonic(), launcher.ready_status()))
            time.sleep(0.1)

    def stop(self) -> list[tuple[float, int]]:
        self.stopped.set()
        self.thread.join(5)
        return self.statuses
