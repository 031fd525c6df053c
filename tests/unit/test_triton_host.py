"""``--triton-host``: Triton's own ports can listen apart from the public ones (the gateway and the metrics
relay, which bound what a client may send and hold)."""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import threading
import urllib.error
from pathlib import Path

import pytest

from serving.fronts.front_limits import FrontLimits, HttpFrontLimits, front_wanted
from serving.fronts.front_limits import add_arguments as add_front_arguments
from serving.serve import Gateway, busy_ports
from serving.supervision.triton_env import Ports, TritonInstall, TritonServer, free_port, url_host


def test_triton_ports_are_checked_where_triton_listens():
    ports = Ports(free_port(), free_port(), free_port())
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", ports.grpc))
        held.listen()
        assert busy_ports("127.0.0.2", ports, triton_host="127.0.0.2") == []  # another address, another port
        busy = busy_ports("127.0.0.2", ports, triton_host="127.0.0.1")
        assert len(busy) == 1 and busy[0].startswith(f"gRPC port {ports.grpc} on 127.0.0.1 is busy")


def test_the_command_binds_triton_to_its_host(tmp_path):
    server = TritonServer(tmp_path / "repo", tmp_path, Ports(1, 2, 3), host="127.0.0.1", metrics_host="0.0.0.0")
    install = TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", ())
    command = server.command(install)
    assert "--http-address=127.0.0.1" in command and "--grpc-address=127.0.0.1" in command
    assert "--metrics-address=127.0.0.1" in command  # Triton's own page: only the relay reads it


def test_with_the_grpc_front_triton_grpc_listens_on_a_private_loopback_port(tmp_path):
    server = TritonServer(tmp_path / "repo", tmp_path, Ports(1, 2, 3), host="0.0.0.0", grpc_front=FrontLimits())
    command = server.command(TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", ()))
    assert "--grpc-address=127.0.0.1" in command and f"--grpc-port={server.triton_grpc_port}" in command
    assert "--grpc-port=2" not in command and server.triton_grpc_port != 2
    assert "--http-address=0.0.0.0" in command  # the HTTP port is not the front's business
    assert server.triton_grpc == f"127.0.0.1:{server.triton_grpc_port}" and server.grpc_host == "0.0.0.0"


def test_with_the_http_front_triton_http_listens_on_a_private_loopback_port(tmp_path):
    server = TritonServer(tmp_path / "repo", tmp_path, Ports(1, 2, 3), host="0.0.0.0", http_front=HttpFrontLimits())
    command = server.command(TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", ()))
    assert "--http-address=127.0.0.1" in command and f"--http-port={server.triton_http_port}" in command
    assert "--http-port=1" not in command and server.triton_http_port != 1
    assert "--grpc-address=0.0.0.0" in command and "--grpc-port=2" in command  # no gRPC front asked for
    assert server.triton_http == f"127.0.0.1:{server.triton_http_port}" and server.http_host == "0.0.0.0"


def test_each_front_bound_is_a_launcher_flag_checked_against_its_rule():
    parser = argparse.ArgumentParser()
    add_front_arguments(parser)
    args = parser.parse_args(["--grpc-front-keepalive-timeout-seconds", "3", "--http-front-max-connections", "7"])
    assert FrontLimits.from_flags(args) == FrontLimits(keepalive_timeout_seconds=3.0)
    assert HttpFrontLimits.from_flags(args) == HttpFrontLimits(max_connections=7)
    assert FrontLimits().max_connections == 512 and HttpFrontLimits().idle_seconds == 60.0  # the documented defaults
    for flag, value in (("--grpc-front-max-streams-per-connection", "0"), ("--grpc-front-idle-seconds", "nan"),
                        ("--grpc-front-keepalive-timeout-seconds", "0"), ("--http-front-max-unsent-mb", "0"),
                        ("--http-front-max-body-mb", "-1")):  # fmt: skip
        bad = parser.parse_args([flag, value])
        with pytest.raises(ValueError, match=flag.partition("-front-")[2].replace("-", "_")):
            (FrontLimits if flag.startswith("--grpc") else HttpFrontLimits).from_flags(bad)


def test_the_front_is_on_by_default_only_where_triton_grpc_would_be_public():
    assert front_wanted("auto", True) and not front_wanted("auto", False)
    assert front_wanted("on", False) and not front_wanted("off", True)


def test_the_grpc_port_is_checked_where_the_front_listens():
    ports = Ports(free_port(), free_port(), free_port())
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.2", ports.grpc))
        held.listen()
        assert busy_ports("127.0.0.1", ports, triton_host="127.0.0.1", front_host="127.0.0.3") == []
        busy = busy_ports("127.0.0.3", ports, triton_host="127.0.0.1", front_host="127.0.0.2")
        assert len(busy) == 1 and busy[0].startswith(f"gRPC port {ports.grpc} on 127.0.0.2 is busy")


def test_the_http_port_is_checked_where_the_http_front_listens():
    ports = Ports(free_port(), free_port(), free_port())
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.2", ports.http))
        held.listen()
        assert busy_ports("127.0.0.1", ports, triton_host="127.0.0.1", http_front_host="127.0.0.3") == []
        busy = busy_ports("127.0.0.3", ports, triton_host="127.0.0.1", http_front_host="127.0.0.2")
        assert len(busy) == 1 and busy[0].startswith(f"HTTP port {ports.http} on 127.0.0.2 is busy")


def test_segments_of_a_dead_starter_are_removed_and_a_live_ones_kept(tmp_path):
    """A server whose starting process was killed (SIGKILL: no stop, no watchdog) leaves its /dev/shm
    segments; the next server's start removes them, and never those of a process still running."""
    import subprocess
    import sys

    from serving.supervision.shm import remove_segments

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"tts{gone.pid}_8001_abc"
    live = tmp_path / f"tts{os.getpid()}_8001_def"
    other = tmp_path / "not_ours"
    for path in (dead, live, other):
        path.write_bytes(b"x")
    assert remove_segments(shm_dir=tmp_path) == [dead.name]
    assert not dead.exists() and live.exists() and other.exists()


class _Flaky(http.server.BaseHTTPRequestHandler):
    """A metrics port that answers 503 for its first ``server.fails`` scrapes (Triton's, just after ready)."""

    def do_GET(self):
        self.server.fails -= 1
        status, body = (503, b"metrics unavailable\n") if self.server.fails >= 0 else (200, b"tts_up 1\n")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def flaky_metrics(tmp_path):
    port = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    port.fails = 3
    threading.Thread(target=port.serve_forever, daemon=True).start()
    (tmp_path / "repo").mkdir()
    yield port, TritonServer(tmp_path / "repo", tmp_path, Ports(1, 2, port.server_address[1]))
    port.shutdown()
    port.server_close()


def test_a_metrics_port_answering_503_briefly_is_read_again(flaky_metrics):
    port, server = flaky_metrics
    assert server.metrics_text(timeout=2) == "tts_up 1\n" and port.fails == -1


def test_a_metrics_port_answering_503_for_good_is_an_error(flaky_metrics):
    port, server = flaky_metrics
    port.fails = 10**6
    with pytest.raises(urllib.error.HTTPError, match="503"):
        server.metrics_text(timeout=2, retry_503=0.2)
    assert port.fails < 10**6 - 1  # asked again before


def test_the_supervisor_counts_a_brief_503_as_an_answer(flaky_metrics, tmp_path):
    """A 503 right after ready is not 'the metrics port has not answered' (the --stall-seconds rule); the retry
    stays within the poll's read, so that a poll never looks like a pause (vitals.PAUSE_SECONDS)."""
    from serving.supervision.supervise import POLL_SECONDS, Supervisor
    from serving.supervision.vitals import PAUSE_SECONDS

    port, server = flaky_metrics
    port.fails, read, asked = 2, server.metrics_text, []  # two 503s, 0.1 s apart
    server.metrics_text = lambda timeout, retry_503: asked.append(timeout + retry_503) or read(timeout, retry_503)
    assert Supervisor(server, tmp_path)._observe().metrics == {}
    port.fails = 10**6  # for good: no answer this poll
    assert Supervisor(server, tmp_path)._observe().metrics is None
    assert all(seconds + 0.1 + POLL_SECONDS < PAUSE_SECONDS for seconds in asked)


@pytest.mark.parametrize("libdir", ["", None, "relative/lib"])
def test_no_empty_or_relative_library_folder_reaches_ld_library_path(tmp_path, monkeypatch, libdir):
    import sysconfig

    from serving.supervision.triton_env import find_triton

    monkeypatch.chdir(tmp_path)
    (tmp_path / "relative" / "lib").mkdir(parents=True)
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: libdir if name == "LIBDIR" else None)
    install = find_triton(tmp_path / "work")
    assert all(p.is_absolute() for p in install.lib_dirs) and Path(".") not in install.lib_dirs


def test_the_launcher_reaches_each_host_at_an_address_a_url_can_name(monkeypatch):
    """A wildcard address is no destination, and an IPv6 one goes in brackets: Triton's own ports and the
    gateway's /health probe (``--host ::1`` once probed http://::1:8080, which never answers)."""
    cases = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "::1": "[::1]", "127.0.0.2": "127.0.0.2", "host.lan": "host.lan"}
    assert {host: url_host(host) for host in cases} == cases
    server = TritonServer(Path("repo"), Path("run"), Ports(8000, 8001, 8002), host="::1")
    assert server.triton_grpc == "[::1]:8001" and server.triton_http == "[::1]:8000"
    monkeypatch.setattr(Gateway, "_start", lambda self: None)  # no process: only its address is read
    assert Gateway("::1", server.triton_grpc, 8080, True, []).base == "http://[::1]:8080"
    assert Gateway("0.0.0.0", server.triton_grpc, 8080, True, []).base == "http://127.0.0.1:8080"
