"""docs/triton.md#T24: a process that imported ``serving`` forks and execs while gRPC threads run, and every
child starts (with gRPC's fork support on, a few in a hundred aborted between fork and exec)."""

from __future__ import annotations

import os
import subprocess
import sys

from serving.supervision.triton_env import REPO_ROOT

PROBE = r"""
import serving  # first, as the launcher and the tests import it
import os, subprocess, threading
from concurrent import futures
import grpc
from serving.supervision.triton_env import die_with_parent

print("fork support:", os.environ["GRPC_ENABLE_FORK_SUPPORT"])
server = grpc.server(futures.ThreadPoolExecutor(4))
server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel("127.0.0.1:1")  # nobody there: its threads keep polling

def busy():
    while True:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.01)
        except Exception:
            pass

for _ in range(4):
    threading.Thread(target=busy, daemon=True).start()
codes = [subprocess.Popen(["/bin/true"], preexec_fn=die_with_parent).wait() for _ in range(CHILDREN)]
print("children that did not start:", sum(code != 0 for code in codes))
"""


def test_children_forked_beside_grpc_threads_all_start():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # serving's default, not ours
    done = subprocess.run([sys.executable, "-c", PROBE.replace("CHILDREN", "300")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fork support: false" in done.stdout, done.stdout
    assert "children that did not start: 0" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "skipping fork() handlers" not in done.stderr  # gRPC's fork handlers are not installed at all
