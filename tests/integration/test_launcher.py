"""`python -m serving.serve`: serves from a run folder of its own with a per-run Triton key (the operator's
admin key on no command line), warns when run as root, refuses busy ports and an exposed host without a key
before writing anything, and takes tritonserver and its stubs with it when killed; a stream through the
fronts ends with an error at once when tritonserver or the launcher is killed, and the fronts serve the
restarted tritonserver. (SIGTERM and restarts: test_supervision.py.) The last test kills the module's
launcher."""

from __future__ import annotations

import http.client
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from client.request import http_body, request_fields
from serving.supervision.triton_env import ADMIN_HEADER, REPO_ROOT, Ports
from tests.integration.launcher import HeldStream, Launcher, gone

pytestmark = pytest.mark.integration


OPERATOR_KEY = f"operator-{os.urandom(12).hex()}"
FAIL_WITHIN = 30.0  # seconds: a stream through a front ends this soon after what serves it is killed (a hang: never)
RESTART_WITHIN = 300.0  # seconds: the supervisor's new tritonserver is ready (a start took 105 s under load)


@pytest.fixture(scope="module")
def launcher(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launcher")
    (tmp / "key").write_text(OPERATOR_KEY + "\n")
    # the gRPC and HTTP ports are the bounded fronts (serving.fronts.grpc_front, serving.fronts.http_front): every
    # gRPC and HTTP call below goes through them; the HTTP front's idle bound is RESTART_WITHIN, so that a kept-alive
    # client connection outlives a tritonserver restart
    # --gateway-args: the gateway takes the operator's options (a share of one socket an address, tested below)
    args = ("--slots", "2", "--admin-key-file", str(tmp / "key"), "--grpc-front", "on", "--http-front", "on",
            "--http-front-idle-seconds", str(RESTART_WITHIN), "--gateway-args", "--agent-sockets-per-peer 1")  # fmt: skip
    with Launcher.start(tiny_ckpt, tmp, *args) as ln:
        ln.wait_ready()
        yield ln


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "serving.serve", *args]
    return subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def test_serves_from_a_run_folder_of_its_own_with_a_private_triton_key(launcher):
    audio = launcher.client().synthesize("Launcher", seed=1, parameters={"max_patches": 6})
    assert audio.size > 0
    import httpx  # the OpenAI-compatible gateway comes up with the server

    speech = httpx.post(f"http://127.0.0.1:{launcher.openai}/v1/audio/speech", timeout=60,
                        json={"input": "Launcher", "seed": 1, "max_patches": 6, "response_format": "pcm"})  # fmt: skip
    assert speech.status_code == 200 and len(speech.content) == 2 * audio.size
    run, text = launcher.run_dir, launcher.text()
    assert re.fullmatch(rf"\d{{8}}T\d{{6}}Z-{launcher.proc.pid}", run.name) and "ready in" in text
    assert f"gRPC 127.0.0.1:{launcher.ports.grpc} (the bounded front)," in text
    assert f"HTTP http://127.0.0.1:{launcher.ports.http} (the bounded front)," in text
    assert not (run / "admin_key").exists()  # the operator gave one
    key_file = run / "triton_admin_key"
    assert f"Triton admin key (repository index, shared memory, logging, trace): {key_file}" in text
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(run.stat().st_mode) == 0o700
    key = key_file.read_text().strip()
    assert key and key not in text and key != OPERATOR_KEY
    assert {p.name.split(".")[0] for p in (run / "heartbeat").iterdir()} == set(launcher.stubs())
    index = f"http://127.0.0.1:{launcher.ports.http}/v2/repository/index"
    with urllib.request.urlopen(urllib.request.Request(index, b"{}", {ADMIN_HEADER: key})) as r:
        assert r.status == 200
    for headers in ({}, {ADMIN_HEADER: OPERATOR_KEY}):  # the operator's key is the voices', not Triton's
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(index, b"{}", headers))
        assert refused.value.code == 403


def test_the_operators_admin_key_is_on_no_command_line(launcher):
    """Triton's restricted APIs take their key on its command line, which any local user can read; the
    operator's key reaches the voices model as a digest in the environment, and still works there."""
    from client import TTSError
    from client.voices import VoiceClient

    url = f"127.0.0.1:{launcher.ports.grpc}"
    with pytest.raises(TTSError, match="is not registered"):  # past the admin check
        VoiceClient(url, admin_key=OPERATOR_KEY).remove("nobody")
    with pytest.raises(TTSError, match="the admin key is wrong"):
        VoiceClient(url, admin_key="wrong").remove("nobody")
    seen, triton_key = 0, (launcher.run_dir / "triton_admin_key").read_text().strip()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:  # exited meanwhile
            continue
        assert OPERATOR_KEY.encode() not in argv, f"{cmdline}: {argv[:200]!r}"
        seen += triton_key.encode() in argv
    assert seen == 1  # tritonserver's: the scan did read the run's command lines


def test_running_as_root_is_warned_about(launcher):
    lines = [line for line in launcher.text().splitlines() if line.startswith("warning: running as root")]
    assert len(lines) == (1 if os.geteuid() == 0 else 0), lines
    if lines:
        assert "stubs" in lines[0] and "uid 1000" in lines[0]


def test_busy_ports_are_refused_before_anything_is_written(launcher, tiny_ckpt, tmp_path):
    """No run folder, no server: nothing of the refused launcher's (its free HTTP port) in the running one's log
    either. (The running server's own log may grow meanwhile: it is not compared by size.)"""
    log = launcher.run_dir / "tritonserver.log"
    before, http = sorted(launcher.run_dir.parent.iterdir()), Ports.free().http
    p = launcher.ports
    r = serve("--checkpoint", str(tiny_ckpt), "--work-dir", str(launcher.run_dir.parent), "--http-port", str(http),
              "--grpc-port", str(p.grpc), "--metrics-port", str(p.metrics), "--openai-port", str(launcher.openai))  # fmt: skip
    assert r.returncode == 2, r.stderr
    for name, port, option in (
        ("gRPC", p.grpc, "--grpc-port"),
        ("metrics", p.metrics, "--metrics-port"),
        ("OpenAI", launcher.openai, "--openai-port"),
    ):  # all of them, in one run
        assert f"{name} port {port} on 127.0.0.1 is busy" in r.stderr and f"move it with {option}" in r.stderr, r.stderr
    assert "HTTP port" not in r.stderr
    assert sorted(launcher.run_dir.parent.iterdir()) == before
    assert f":{http}" not in log.read_text(errors="replace")
    assert launcher.ready_status() == 200


def test_the_launcher_prints_the_web_pages_address_and_it_serves_the_page(launcher):
    import httpx

    (line,) = [line for line in launcher.text().splitlines() if line.startswith("web page: ")]
    assert line == f"web page: http://127.0.0.1:{launcher.openai}/"
    page = httpx.get(line.removeprefix("web page: "), timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


def test_the_addresses_come_once_everything_answers_with_a_note_on_random_weights(launcher):
    """It says "starting" at once; the addresses only after tritonserver is ready and the gateway answers, then
    "ready"; the tiny checkpoint's random weights are explained (in the output and on the page)."""
    import httpx

    deadline = time.monotonic() + 60
    while not any(line.startswith("ready: ") for line in launcher.text().splitlines()):
        assert time.monotonic() < deadline, f"no ready line:\n{launcher.text()}"
        time.sleep(0.2)
    lines = launcher.text().splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    assert first("note: random weights") < first("starting: ") < first("[supervisor] ready in ")
    assert first("[supervisor] ready in ") < first("OpenAI-compatible speech API: ") < first("web page: ")
    assert first("web page: ") < first("ready: ")
    assert "semantic edit's transcript is empty" in lines[first("note: random weights")]
    assert httpx.get(f"http://127.0.0.1:{launcher.openai}/health", timeout=10).status_code == 200
    page = httpx.get(f"http://127.0.0.1:{launcher.openai}/", timeout=10).text
    assert 'id="notice"' in page and "random weights" in page


def test_the_gateway_takes_the_operators_options(launcher):
    """``--gateway-args '--agent-sockets-per-peer 1'``: a second agent socket from this address is refused by name."""
    import json

    import websocket  # websocket-client

    url = f"ws://127.0.0.1:{launcher.openai}/tts/websocket?cartesia_version=2025-04-16"
    first = websocket.create_connection(url, timeout=30)
    try:
        second = websocket.create_connection(url, timeout=30)
        refused = json.loads(second.recv())
        second.close()
    finally:
        first.close()
    assert refused["type"] == "error" and refused["error"].startswith("too many sockets from your address: at most 1")


def test_a_dead_gateway_is_started_again(launcher):
    import httpx

    def gateway_pids():
        out = subprocess.run(
            ["pgrep", "-P", str(launcher.proc.pid), "-f", "gateway --triton"], capture_output=True, text=True
        )
        return [int(x) for x in out.stdout.split()]

    jobs = f"http://127.0.0.1:{launcher.openai}/v1/audio/jobs"  # a job made before the kill outlives it
    job = httpx.post(jobs, json={"input": "Kept.", "response_format": "wav", "seed": 3, "max_patches": 4},
                     timeout=30).json()  # fmt: skip
    while job["status"] in ("queued", "running"):
        time.sleep(0.1)
        job = httpx.get(f"{jobs}/{job['id']}", timeout=30).json()
    assert job["status"] == "done", job
    made = httpx.get(f"{jobs}/{job['id']}/audio", timeout=30).content
    (pid,) = gateway_pids()
    os.kill(pid, signal.SIGKILL)
    deadline, status = time.monotonic() + 30, 0
    while time.monotonic() < deadline and status != 200:
        time.sleep(0.5)
        try:
            status = httpx.get(f"http://127.0.0.1:{launcher.openai}/health", timeout=2).status_code
        except httpx.HTTPError:
            status = 0
    assert status == 200 and gateway_pids() and pid not in gateway_pids()
    (new,) = gateway_pids()  # started again with the operator's options
    with open(f"/proc/{new}/cmdline") as cmdline:
        assert "--agent-sockets-per-peer\x001" in cmdline.read()
    assert httpx.get(f"{jobs}/{job['id']}/audio", timeout=30).content == made  # kept in --state-dir's jobs/
    text = launcher.text()
    assert "gateway exited with -9; restarting it in 0.5 s (1 restarts so far)" in text
    # one restart: a restarted gateway that exits again is a bug (one aborted before exec: docs/triton.md#T24)
    exits = [line for line in text.splitlines() if "[supervisor] gateway exited with " in line]
    assert len(exits) == 1, exits
    page = httpx.get(f"http://127.0.0.1:{launcher.ports.metrics}/metrics", timeout=10).text
    assert "\ntts_gateway_restarts_total 1\n" in page, page[-500:]


def test_an_exposed_host_needs_an_admin_key(tiny_ckpt, tmp_path):
    ports = Ports.free()
    r = serve("--checkpoint", str(tiny_ckpt), "--host", "0.0.0.0", "--work-dir", str(tmp_path / "runs"),
              "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics))  # fmt: skip
    assert r.returncode == 2 and "--host 0.0.0.0" in r.stderr and "--admin-key" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def http_stream(launcher: Launcher, conn: http.client.HTTPConnection | None = None):
    """A short generate_stream through the HTTP front (on ``conn``, kept alive, if given) -> (status, its body)."""
    conn = conn or http.client.HTTPConnection("127.0.0.1", launcher.ports.http, timeout=60)
    body = http_body(request_fields("Through the HTTP front.", seed=1), {"max_patches": 4})
    conn.request("POST", "/v2/models/tts/generate_stream", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def test_a_killed_tritonserver_ends_the_streams_through_the_fronts_at_once_and_they_serve_after_the_restart(launcher):
    """SIGKILL of tritonserver under a running stream: the front ends it with an error within FAIL_WITHIN (not
    a hang); the supervisor starts a new tritonserver, and both fronts serve it, a kept-alive HTTP client
    connection of the old one's included."""
    kept = http.client.HTTPConnection("127.0.0.1", launcher.ports.http, timeout=60)
    assert http_stream(launcher, kept)[0] == 200
    stream = HeldStream(launcher)
    assert stream.started.wait(60) and not stream.done.is_set(), stream.error
    (server,) = launcher.servers()
    os.kill(server, signal.SIGKILL)
    killed = time.monotonic()
    assert stream.done.wait(FAIL_WITHIN), f"the stream through the front still hangs {FAIL_WITHIN} s after the kill"
    assert stream.error is not None
    print(f"tritonserver SIGKILL: the stream through the gRPC front ended {stream.ended - killed:.2f} s later: "
          f"{type(stream.error).__name__}: {stream.error}")  # fmt: skip
    stream.release.set()
    deadline = time.monotonic() + RESTART_WITHIN
    while launcher.servers() in ([], [server]) or launcher.ready_status() != 200:
        assert time.monotonic() < deadline, f"no new tritonserver ready:\n{launcher.text()}"
        time.sleep(0.25)
    print(f"ready again {time.monotonic() - killed:.1f} s after the kill")
    assert launcher.client().synthesize("After the restart.", seed=1, parameters={"max_patches": 4}).size > 0
    status, body = http_stream(launcher, kept)  # the client's connection outlived the old tritonserver
    assert status == 200 and body.startswith(b"data: "), (status, body[:300])
    kept.close()


def test_a_killed_launcher_takes_tritonserver_and_its_stubs_with_it(launcher):
    servers, stubs = launcher.servers(), list(launcher.stubs().values())
    assert len(servers) == 1 and len(stubs) == 6  # every Python model's (tts_ensemble has none)
    stream = HeldStream(launcher)  # running through the gRPC front, which dies with the launcher
    assert stream.started.wait(60) and not stream.done.is_set(), stream.error
    killed = time.monotonic()
    launcher.proc.send_signal(signal.SIGKILL)
    launcher.proc.wait(10)
    t0 = time.monotonic()
    assert stream.done.wait(FAIL_WITHIN) and stream.error is not None, "the stream hangs after the launcher's kill"
    print(f"launcher SIGKILL: the stream through the front ended {stream.ended - killed:.2f} s later: {stream.error}")
    assert gone(servers, 5), "tritonserver outlived its launcher"
    assert gone(stubs, 5), "stubs outlived their tritonserver"
    deadline = time.monotonic() + 5  # the launcher's watchdog removes its shared memory
    while list(Path("/dev/shm").glob(f"{launcher.shm_prefix}*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(Path("/dev/shm").glob(f"{launcher.shm_prefix}*"))
    print(f"launcher SIGKILL: tritonserver and stubs gone after {time.monotonic() - t0:.1f} s")
