"""`python -m serving.serve`: comes up, serves, and leaves no tritonserver behind on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from client import TTSClient
from serving.triton_env import REPO_ROOT, Ports

pytestmark = pytest.mark.integration


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_serve_starts_serves_and_stops_cleanly(tiny_ckpt, tmp_path):
    ports = Ports.free()
    cmd = [
        sys.executable, "-m", "serving.serve", "--checkpoint", str(tiny_ckpt), "--slots", "2",
        "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
        "--voice-dir", str(tmp_path / "voices"), "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("server not ready in 120 s")
        servers = _children_of(proc.pid)
        assert servers, "the launcher has no tritonserver child"
        audio = TTSClient(f"127.0.0.1:{ports.grpc}").synthesize("Launcher", seed=1, parameters={"max_patches": 6})
        assert audio.size > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "ready in" in log and "tritonserver stopped" in log
    for pid in servers:  # the server (and with it its stubs) is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
