"""Find a ``tritonserver`` (the NGC image's, else the ``nvidia-pytriton`` wheel's with a private Python-backend
folder and the stub for this Python) and run it: for the launcher (:mod:`serving.serve`) and the tests."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serving.fronts.front_limits import FrontLimits, HttpFrontLimits
from serving.fronts.metrics_relay import MetricsRelay
from serving.security.auth import ADMIN_DIGEST_ENV, GENERATOR, INTERNAL_KEY_ENV, Keys
from serving.supervision.shm import remove_segments

if TYPE_CHECKING:  # imported when the front starts: grpc stays out of a launcher without it
    from serving.fronts.grpc_front import GrpcFront
    from serving.fronts.http_front import HttpFront

REPO_ROOT = Path(__file__).resolve().parents[2]
NGC_ROOT = Path("/opt/tritonserver")
# Triton's APIs refused without the Triton key (docs/security.md has the table; docs/triton.md#T16). Statistics
# name every model and a model's config is its own (the generator's is under its secret name).
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics", "model-config")
ADMIN_HEADER = "admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-admin-key"
METRICS_503_SECONDS = 2.0  # a metrics port answering 503 is asked again this long
READY_TIMEOUT = 180.0  # seconds a starting tritonserver may take to answer ready (loading every model)


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path  # holds python/ with libtriton_python.so and triton_python_backend_stub
    lib_dirs: tuple[Path, ...]


def find_triton(work_dir: Path) -> TritonInstall:
    """Locate tritonserver; for the pytriton wheel, assemble ``work_dir/backends/python`` with the stub."""
    if (NGC_ROOT / "bin" / "tritonserver").is_file():
        return TritonInstall(NGC_ROOT / "bin" / "tritonserver", NGC_ROOT / "backends", ())
    try:
        import pytriton
    except ImportError as e:
        raise RuntimeError("no tritonserver: not in /opt/tritonserver and nvidia-pytriton is not installed") from e
    root = Path(pytriton.__file__).parent / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {ver} ({stub})")
    dest = work_dir / "backends" / "python"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(root / "backends" / "python", dest, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, dest / "triton_python_backend_stub")
    libs = [Path(sysconfig.get_config_var("LIBDIR") or "."), root.parent.parent / "nvidia_pytriton.libs"]
    libs = tuple(p for p in libs if p.is_absolute() and p.is_dir())  # a relative one: the working directory
    return TritonInstall(root / "bin" / "tritonserver", dest.parent, libs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> Ports:
        return cls(free_port(), free_port(), free_port())


_LIBC, PR_SET_PDEATHSIG = ctypes.CDLL(None, use_errno=True), 1


def die_with_parent() -> None:
    """``preexec_fn``: the kernel SIGKILLs the child when the thread that started it dies (its stubs exit on their
    own: run_folder). Runs between fork and exec: no imports."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def url_host(host: str) -> str:
    """``host`` as this machine reaches it in a URL: a wildcard address is no destination, IPv6 in brackets."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


@dataclass
class TritonServer:
    """A running tritonserver child process. Use as a context manager; it is always stopped."""

    model_repository: Path
    work_dir: Path
    ports: Ports = field(default_factory=Ports)
    host: str = "127.0.0.1"  # Triton's HTTP and gRPC ports listen here
    metrics_host: str | None = None  # the metrics relay listens here (None: ``host``)
    log_path: Path | None = None
    # The operator's key (its SHA-256 reaches the models) and Triton's for RESTRICTED_APIS: docs/security.md
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    triton_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    internal_key: str = field(default_factory=lambda: secrets.token_hex(32))
    proc: subprocess.Popen | None = None
    # Triton's own metrics page, on loopback: the metrics port is a relay that does not name the generator
    triton_metrics_port: int = field(default_factory=free_port)
    relay: MetricsRelay | None = None
    # With grpc_front (http_front) limits, ports.grpc (ports.http) is the bounded front (serving.fronts) on
    # front_host (metrics_host, else host), and Triton's own listens on loopback at triton_grpc_port (_http_).
    grpc_front: FrontLimits | None = None
    triton_grpc_port: int = field(default_factory=free_port)
    front: GrpcFront | None = None
    http_front: HttpFrontLimits | None = None
    triton_http_port: int = field(default_factory=free_port)
    http_proxy: HttpFront | None = None

    @property
    def generator_model(self) -> str:  # its name in Triton, a secret of the run (serving.security.auth.Keys)
        return Keys(self.internal_key).generator_model

    @property
    def shm_prefix(self) -> str:  # of this server's Python-backend /dev/shm segments (cleaned up by the launcher)
        return f"tts{os.getpid()}_{self.ports.grpc}_"

    @property
    def local_host(self) -> str:
        return url_host(self.host)

    @property
    def grpc_host(self) -> str:  # where ports.grpc listens (ports.http: http_host): the front's host, or Triton's
        return (self.metrics_host or self.host) if self.grpc_front else self.host

    @property
    def http_host(self) -> str:
        return (self.metrics_host or self.host) if self.http_front else self.host

    @property
    def triton_http(self) -> str:  # Triton's own host:port (triton_grpc: gRPC) as this machine reaches it
        return f"127.0.0.1:{self.triton_http_port}" if self.http_front else f"{self.local_host}:{self.ports.http}"

    @property
    def triton_grpc(self) -> str:
        return f"127.0.0.1:{self.triton_grpc_port}" if self.grpc_front else f"{self.local_host}:{self.ports.grpc}"

    def command(self, install: TritonInstall) -> list[str]:
        http, grpc = ("127.0.0.1" if front else self.host for front in (self.http_front, self.grpc_front))
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.triton_key}"
        return [str(install.binary), f"--model-repository={self.model_repository}",
                f"--backend-directory={install.backend_dir}",
                "--model-control-mode=none",  # every model of the repository loads at start; none later
                "--exit-timeout-secs=5",  # stopping waits this long for the models to unload (after the drain)
                f"--http-address={http}", f"--grpc-address={grpc}", "--metrics-address=127.0.0.1",
                f"--http-port={self.triton_http_port if self.http_front else self.ports.http}",
                f"--grpc-port={self.triton_grpc_port if self.grpc_front else self.ports.grpc}",
                f"--metrics-port={self.triton_metrics_port}", "--log-verbose=0",
                "--backend-config=python,shm-default-byte-size=67108864",
                "--backend-config=python,shm-growth-byte-size=16777216",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]  # fmt: skip

    def start(self) -> TritonServer:
        remove_segments()  # of servers whose starter was SIGKILLed
        # the generator is served under its secret name: its folder and config renamed (once)
        plain, hidden = self.model_repository / GENERATOR, self.model_repository / self.generator_model
        if plain.is_dir() and plain != hidden:
            config = plain / "config.pbtxt"
            config.write_text(config.read_text().replace(f'name: "{GENERATOR}"', f'name: "{hidden.name}"', 1))
            plain.rename(hidden)
        if self.relay is None:
            source = f"http://127.0.0.1:{self.triton_metrics_port}/metrics"
            self.relay = MetricsRelay(self.metrics_host or self.host, self.ports.metrics, source, self.generator_model)
        if self.grpc_front and self.front is None:  # it outlives restarts, as the relay does
            from serving.fronts.grpc_front import GrpcFront

            self.front = GrpcFront(self.grpc_host, self.ports.grpc, self.triton_grpc, self.grpc_front).start()
        if self.http_front and self.http_proxy is None:
            from serving.fronts.http_front import HttpFront

            upstream = ("127.0.0.1", self.triton_http_port)
            self.http_proxy = HttpFront(self.http_host, self.ports.http, upstream, self.http_front).start()
        install = find_triton(self.work_dir)
        self.log_path = self.log_path or self.work_dir / "tritonserver.log"
        # 0600: Triton logs the generator's secret model name (its stub's name, its load and unload)
        log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        os.fchmod(log.fileno(), 0o600)
        path = lambda name, *first: os.pathsep.join(str(p) for p in (*first, os.environ.get(name)) if p)  # noqa: E731
        env = {"OMP_NUM_THREADS": "1", **os.environ, "LD_LIBRARY_PATH": path("LD_LIBRARY_PATH", *install.lib_dirs),
               "PATH": path("PATH", Path(sys.executable).parent), "PYTHONPATH": path("PYTHONPATH", REPO_ROOT),
               INTERNAL_KEY_ENV: self.internal_key, ADMIN_DIGEST_ENV: Keys.digest(self.admin_key)}  # fmt: skip
        self.proc = subprocess.Popen(self.command(install), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        log.close()
        return self

    def is_ready(self) -> bool:
        """One readiness probe; raises RuntimeError if the server has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; log:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://{self.triton_http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT, stopping=lambda: False) -> bool:
        """Until ready (True) or ``stopping()`` (False); RuntimeError once it exited, TimeoutError (and stopped)
        after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if stopping():
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; log:\n{self.log_tail()}")
            time.sleep(0.25)
        return True

    def metrics_text(self, timeout: float = 10.0, retry_503: float = METRICS_503_SECONDS) -> str:
        """The metrics port's page (Prometheus text). A 503 (the relay's while Triton's own page does not answer,
        as just after ready) is asked again for up to ``retry_503`` seconds before it is an error."""
        url, deadline = f"http://{self.local_host}:{self.ports.metrics}/metrics", time.monotonic() + retry_503
        while True:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                if e.code != 503 or time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    def metrics(self, prefixes: tuple[str, ...] = ("tts_",)) -> dict[str, float]:
        """Samples whose names start with ``prefixes``, keyed by name with its labels."""
        lines = (line.rpartition(" ") for line in self.metrics_text().splitlines())
        return {name: float(value) for name, _, value in lines if name.startswith(prefixes)}

    def log_tail(self, n: int = 60) -> str:
        exists = self.log_path and self.log_path.exists()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if exists else ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group (stubs included), SIGKILL it after ``timeout``; remove its shm."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired, ProcessLookupError):
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(timeout)
            # a tritonserver past ``timeout``, or a stub it gave up on (--exit-timeout-secs), is still in its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        remove_segments(self.shm_prefix)

    def close(self) -> None:
        """Stop the server, its metrics relay and its fronts."""
        self.stop()
        for name in ("relay", "front", "http_proxy"):
            if (part := getattr(self, name)) is not None:
                part.close()
                setattr(self, name, None)

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
