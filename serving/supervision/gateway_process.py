"""The OpenAI gateway's process under the launcher (:mod:`serving.serve`)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from serving.fronts.metrics_relay import LAUNCHER
from serving.supervision.supervise import say
from serving.supervision.triton_env import REPO_ROOT, die_with_parent

BACKOFF_FIRST, BACKOFF_MOST, BACKOFF_RESET = 0.5, 30.0, 60.0  # seconds: a crashing gateway's restarts
GATEWAY_STOP_SECONDS = 5.0  # SIGTERM -> SIGKILL of the gateway at shutdown
GATEWAY_RESTARTS = "tts_gateway_restarts_total"
GATEWAY_WAIT = 30.0  # seconds the launcher waits, once tritonserver is ready, for the gateway to answer


class Gateway:
    """``python -m gateway`` on ``host:port`` for this server: it dies with the launcher, and the launcher
    starts it again (and says so) if it exits on its own."""

    def __init__(self, host: str, triton: str, port: int, random_weights: bool, more: list[str]):
        """``triton``: Triton's own gRPC address as this machine reaches it (``TritonServer.triton_grpc``);
        ``more``: the operator's further gateway options (``--gateway-args``, checked by the launcher)."""
        self.cmd = [sys.executable, "-m", "gateway", "--triton", triton, "--host", host, "--port", str(port),
                    *(["--random-weights"] if random_weights else []), *more]  # fmt: skip
        self.proc, self.started = self._start(), time.monotonic()
        self.restarts, self.backoff, self.restart_at = 0, BACKOFF_FIRST / 2, 0.0
        LAUNCHER.add(GATEWAY_RESTARTS, "times the launcher restarted the OpenAI gateway after it exited")
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # a browser cannot open 0.0.0.0
        self.base = f"http://{shown}:{port}"

    def announce(self, stopping) -> None:
        """Its addresses once it reaches the ready tritonserver (``/health`` 200; never before: a request sent
        earlier would be refused), at most GATEWAY_WAIT s later (restarting a gateway that exits meanwhile)."""
        deadline = time.monotonic() + GATEWAY_WAIT
        while not stopping():
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:  # refused, not ready (HTTPError 503), timed out
                pass
            if time.monotonic() > deadline:
                say(f"warning: the OpenAI gateway does not answer {GATEWAY_WAIT:g} s after tritonserver got ready; "
                    "its addresses:", prefix="")  # fmt: skip
                break
            self.keep_up()
            time.sleep(0.1)
        say(f"OpenAI-compatible speech API: {self.base}/v1/audio/speech\nweb page: {self.base}/", prefix="")

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, cwd=REPO_ROOT, preexec_fn=die_with_parent)

    def keep_up(self) -> None:
        """Restart a gateway that exited, waiting twice as long after each exit in a row (0.5 s up to 30 s;
        back to 0.5 s once one stayed up a minute), so that a gateway that cannot start does not spin."""
        now = time.monotonic()
        if self.proc is None:
            if now >= self.restart_at:
                self.proc, self.started = self._start(), now
            return
        if self.proc.poll() is None:
            return
        self.restarts += 1
        LAUNCHER.increment(GATEWAY_RESTARTS)
        self.backoff = BACKOFF_FIRST if now - self.started >= BACKOFF_RESET else min(2 * self.backoff, BACKOFF_MOST)
        say(f"gateway exited with {self.proc.returncode}; restarting it in {self.backoff:g} s "
            f"({self.restarts} restarts so far)")  # fmt: skip
        self.proc, self.restart_at = None, now + self.backoff

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(GATEWAY_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
