"""``--triton-host``: Triton's own ports can listen apart from the public ones (the gateway and the metrics
relay, which bound what a client may send and hold)."""

from __future__ import annotations

import socket

from serving.serve import busy_ports
from serving.triton_env import Ports, TritonInstall, TritonServer, free_port


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
