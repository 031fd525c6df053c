"""The bounded HTTP front (serving.fronts.http_front) in front of a real tritonserver: tritonclient.http and a
generate_stream client get what they would get from Triton directly; a body past the bound gets 413
before Triton sees it, a connection that never finishes its head is closed, and the server serves on.

One server with the front serves the module (conftest's ``fronted``, which test_grpc_front shares: it has
the gRPC front too); the tests reach Triton's own HTTP port (loopback) too, to compare."""

from __future__ import annotations

import http.client
import json
import socket

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from client import TTSClient
from tests.integration.helpers import HTTP_FRONT_LIMITS, LEGIT

pytestmark = pytest.mark.integration
LIMITS = HTTP_FRONT_LIMITS  # max_body_mb 2, header_seconds 3


@pytest.fixture(scope="module")
def server(fronted):
    return fronted


@pytest.fixture(scope="module")
def front(server) -> str:
    return f"127.0.0.1:{server.ports.http}"


def chunks(url: str) -> list[np.ndarray]:
    return [chunk.audio for chunk in TTSClient(url, "http", timeout=60).stream(**LEGIT)]


def still_serving(server, front) -> None:
    assert httpclient.InferenceServerClient(front).is_server_ready()
    via_front, direct = chunks(front), chunks(server.triton_http)
    assert len(via_front) == len(direct) > 1
    assert np.array_equal(np.concatenate(via_front), np.concatenate(direct))


def test_triton_http_is_on_loopback_behind_the_front(server):
    assert server.triton_http == f"127.0.0.1:{server.triton_http_port}"
    assert server.triton_http_port != server.ports.http


def test_generate_stream_and_metadata_equal_direct(server, front):
    still_serving(server, front)
    via, direct = (httpclient.InferenceServerClient(u) for u in (front, server.triton_http))
    assert via.get_model_metadata("tts") == direct.get_model_metadata("tts")
    assert via.get_server_metadata() == direct.get_server_metadata()


def test_restricted_api_needs_the_clients_key(server, front):
    """The front adds no privilege: Triton's restricted APIs answer only the key the client sent."""
    client = httpclient.InferenceServerClient(front)
    with pytest.raises(InferenceServerException):
        client.get_model_repository_index()
    index = client.get_model_repository_index(headers={"admin-key": server.triton_key})
    assert "tts" in {m["name"] for m in index}


def test_oversized_body_gets_413_and_the_server_serves_on(server, front):
    conn = http.client.HTTPConnection("127.0.0.1", server.ports.http, timeout=30)
    conn.request("POST", "/v2/models/tts/generate", body=b"[" + b"0.1," * (3 * 2**20 // 4) + b"0]",
                 headers={"content-type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 413 and "--http-front-max-body-mb" in json.loads(r.read())["error"]
    still_serving(server, front)


def test_unfinished_head_is_closed_and_the_server_serves_on(server, front):
    with socket.create_connection(("127.0.0.1", server.ports.http)) as s:
        s.sendall(b"POST /v2/models/tts/generate_stream HTTP/1.1\r\nhost: x\r\n")  # never the blank line
        s.settimeout(60)  # far above header_seconds: the front closes it first
        try:
            assert s.recv(1000) == b""
        except ConnectionResetError:
            pass
    still_serving(server, front)


def test_expect_100_continue_reaches_tritons_100_through_the_front(server):
    """curl sends ``Expect: 100-continue`` before a body over 1 MiB and waits for Triton's ``100 Continue``."""
    body = json.dumps({"text_input": "x"}).encode()
    with socket.create_connection(("127.0.0.1", server.ports.http)) as s:
        s.settimeout(30)
        s.sendall(b"POST /v2/models/tts/generate HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))  # fmt: skip
        assert s.recv(1000).startswith(b"HTTP/1.1 100 ")
        s.sendall(body)
        assert s.recv(1000).startswith(b"HTTP/1.1 400 ")  # Triton read the body: the request lacks inputs
