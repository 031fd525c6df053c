"""A short headless locust run of both user classes against the test server: no failures, no leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serving.triton_env import REPO_ROOT
from tests.integration.helpers import wait_gauges_zero

pytestmark = pytest.mark.integration


def test_locust_headless_run_has_no_failures(server):
    env = {
        **os.environ, "PYTHONPATH": str(REPO_ROOT),
        "TTS_GRPC_HOST": f"127.0.0.1:{server.ports.grpc}", "TTS_HTTP_HOST": f"http://127.0.0.1:{server.ports.http}",
        "TTS_MAX_PATCHES": "8", "TTS_TEXTS": "Load test one|Load test two", "TTS_TIMEOUT": "30",
    }  # fmt: skip
    cmd = [
        sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4",
        "--run-time", "12s", "--stop-timeout", "20",  # users finish their stream, so nothing is cut off
        "--json", "--skip-log", "GrpcStreamUser", "HttpStreamUser",
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as e:  # run() has killed it; a hang is a failure, not a stuck suite
        pytest.fail(f"locust did not stop by itself; stderr:\n{(e.stderr or b'').decode()[-3000:]}")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    stats = {(s["method"], s["name"]): s for s in json.loads(r.stdout)}
    every = {(p, n) for p in ("grpc", "http") for n in ("first_chunk", "stream", "worst_gap")}
    assert every <= set(stats) <= every | {("grpc", "underrun"), ("http", "underrun")}  # few streams underrun
    for key, s in stats.items():
        assert s["num_failures"] == 0, (key, r.stderr.decode()[-3000:])
        assert s["num_requests"] >= 3 or key[1] == "underrun", key
    for p in ("grpc", "http"):
        assert stats[p, "stream"]["num_requests"] == stats[p, "first_chunk"]["num_requests"]
        assert stats[p, "worst_gap"]["num_requests"] == stats[p, "stream"]["num_requests"]  # one per stream
        underran = stats.get((p, "underrun"), {"num_requests": 0, "min_response_time": 1})
        assert underran["num_requests"] <= stats[p, "stream"]["num_requests"] and underran["min_response_time"] > 0
        assert stats[p, "stream"]["total_content_length"] == stats[p, "stream"]["num_requests"] * 8 * 3840 * 4
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
