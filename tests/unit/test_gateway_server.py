"""The gateway's HTTP server on a real uvicorn and loopback sockets (no Triton): slow clients are cut off
by the header and body timeouts, kept-alive connections still work, and the connection limit holds."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import pytest
import uvicorn

from gateway.server import ServerOptions, uvicorn_config
from serving.supervision.triton_env import free_port

PATIENCE = 30.0  # seconds a test waits for what the server should do far sooner: a bound, never a measure


@contextlib.contextmanager
def gateway(**options):
    port = free_port()
    config = uvicorn_config(f"127.0.0.1:{free_port()}", "127.0.0.1", port, ServerOptions(**options), timeout=5,
                            log_level="warning")  # fmt: skip
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + PATIENCE
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started
    try:
        yield port
    finally:
        uv.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def impatient():
    """Half a second for a request's headers; a minute for its body."""
    with gateway(header_timeout=0.5, keep_alive_timeout=5, body_timeout=60) as port:
        yield port


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def response(s: socket.socket) -> bytes:
    """One response with a Content-Length, read off the socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536) or pytest.fail(f"closed mid-response: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += s.recv(65536) or pytest.fail("closed mid-body")
    return head + b"\r\n\r\n" + body


def closed(s: socket.socket) -> bool:
    """Whether the server closes the connection (within PATIENCE) without answering."""
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_a_request_line_then_silence_is_closed(impatient):
    with connect(impatient) as s:
        s.sendall(b"GET /v1/mod")
        t0 = time.monotonic()
        assert closed(s)
        assert time.monotonic() - t0 < PATIENCE


def test_headers_trickled_a_byte_at_a_time_are_closed(impatient):
    """Each byte would reset a keep-alive timer; the header timer counts from the connection."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n"
    with connect(impatient) as s:
        for i in range(len(request)):  # 0.05 s a byte: 100 s for the lot
            try:
                s.sendall(request[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([s], [], [], 0.05)[0]:
                assert closed(s)
                break
        else:
            pytest.fail("the whole trickled request was taken")
    assert i < len(request) - 4  # cut off before the headers were complete


def test_a_body_that_comes_after_the_header_timeout_is_still_read(impatient):
    """The header timer stops once the headers are in: the body is the body timeout's to bound."""
    body = b'{"input": "Hello", "steps": 0}'
    with connect(impatient) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        assert not select.select([s], [], [], 1.0)[0]  # twice the header timeout: nothing, not closed
        s.sendall(body)
        assert response(s).startswith(b"HTTP/1.1 400 ")  # steps 0 is out of range: the body was read


def test_a_kept_alive_connection_serves_one_request_after_another():
    with gateway() as port, connect(port) as s:  # the defaults
        for _ in range(3):
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert response(s).startswith(b"HTTP/1.1 200 ")


def test_a_body_that_does_not_arrive_is_408_and_the_connection_closed():
    with gateway(body_timeout=0.5) as port, connect(port) as s:
        s.sendall(b'POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"input": ')
        answer = response(s)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower()
        assert closed(s)


def test_at_the_connection_limit_new_requests_get_503():
    """uvicorn counts the asking connection: with ``limit_concurrency`` 2, one other open connection is the limit."""
    with gateway(limit_concurrency=2) as port, connect(port) as first:
        first.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(first).startswith(b"HTTP/1.1 200 ")  # now surely counted; it stays open, idle
        with connect(port) as second:
            second.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = response(second)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"connection: close" in answer.lower()
        first.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # alone again: served
        assert response(first).startswith(b"HTTP/1.1 200 ")
