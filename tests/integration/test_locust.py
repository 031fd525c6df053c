"""Short headless locust runs against the test server, closed loop (both protocols) and open loop: no failures,
no leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serving.supervision.triton_env import REPO_ROOT
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
    stalls = {(p, n) for p in ("grpc", "http") for n in ("underrun", "continuity_break")}  # few streams stall
    assert every <= set(stats) <= every | stalls
    for key, s in stats.items():
        assert s["num_failures"] == 0, (key, r.stderr.decode()[-3000:])
        assert s["num_requests"] >= 3 or key in stalls, key
    for p in ("grpc", "http"):
        assert stats[p, "stream"]["num_requests"] == stats[p, "first_chunk"]["num_requests"]
        assert stats[p, "worst_gap"]["num_requests"] == stats[p, "stream"]["num_requests"]  # one per stream
        underran = stats.get((p, "underrun"), {"num_requests": 0, "min_response_time": 1})
        assert underran["num_requests"] <= stats[p, "stream"]["num_requests"] and underran["min_response_time"] > 0
        assert stats[p, "stream"]["total_content_length"] == stats[p, "stream"]["num_requests"] * 8 * 3840 * 4
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_locust_open_loop_run_streams_at_the_rate_and_drains(server):
    """Poisson arrivals at 3/s for 8 s from one user: about 24 streams (a Poisson count; 8..48 is over 3
    standard deviations either side), every one complete, including those still running at the stop."""
    env = {
        **os.environ, "PYTHONPATH": str(REPO_ROOT), "TTS_GRPC_HOST": f"127.0.0.1:{server.ports.grpc}",
        "TTS_RATE": "3", "TTS_ARRIVAL_SEED": "1", "TTS_DRAIN_TIMEOUT": "30",
        "TTS_MAX_PATCHES": "8", "TTS_TEXTS": "Open loop one|Open loop two", "TTS_TIMEOUT": "30",
    }  # fmt: skip
    cmd = [
        sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "1", "-r", "1",
        "--run-time", "8s", "--json", "--skip-log", "GrpcOpenLoopUser",
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"locust did not stop by itself; stderr:\n{(e.stderr or b'').decode()[-3000:]}")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    stats = {s["name"]: s for s in json.loads(r.stdout)}
    assert {"first_chunk", "stream", "worst_gap"} <= set(stats) <= {"first_chunk", "stream", "worst_gap", "underrun",
                                                                    "continuity_break"}  # fmt: skip
    assert all(s["num_failures"] == 0 for s in stats.values()), r.stderr.decode()[-3000:]
    streams = stats["stream"]["num_requests"]
    assert 8 <= streams <= 48
    assert stats["first_chunk"]["num_requests"] == stats["worst_gap"]["num_requests"] == streams
    assert stats["stream"]["total_content_length"] == streams * 8 * 3840 * 4  # all complete
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
