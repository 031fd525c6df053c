"""serving.fronts.http_front against a stand-in upstream (http.server on loopback): what it forwards, what it
refuses before the upstream sees it, and what it does with a client that never finishes its head or never
reads. The real path, tritonserver behind the front, is tests/integration/test_http_front.py."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.fronts.front_limits import HttpFrontLimits
from serving.fronts.http_front import CUT_COUNTER, HttpFront, forwarded_headers
from serving.fronts.metrics_relay import LAUNCHER
from serving.supervision.triton_env import free_port

CHUNK = 32 * 1024


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.server.seen.append((self.path, dict(self.headers)))
        if self.headers.get("transfer-encoding") == "chunked":
            body = b""
            while (size := int(self.rfile.readline().strip(), 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/gated":  # one event, the next only once the test has seen the first
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(2):
                data = f"data: {i}\n\n".encode() if i == 0 or self.server.gate.wait(10) else b"data: late\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path == "/stream":  # chunks until the client is gone
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            try:
                for i in range(int(body or b"0") or 10**9):
                    data = (f"data: {i}\n\n".encode()).ljust(CHUNK if not body else 0, b" ")
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    self.server.sent += 1
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.server.gone.set()
            return
        out = json.dumps({"path": self.path, "bytes": len(body), "probe": self.headers.get("x-probe")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        try:
            self.wfile.write(out)
        except OSError:  # the front or its client left first (the tests that cut a request do): nobody reads it
            pass  # (not `gone`, which the streaming tests wait for: a late one of another test would satisfy them)


class Upstream(ThreadingHTTPServer):
    accepted = 0  # connections accepted, counted in order by the one accepting thread

    def process_request(self, request, client_address):
        self.accepted += 1
        super().process_request(request, client_address)


@pytest.fixture(scope="module")
def upstream():
    server = Upstream(("127.0.0.1", free_port()), Handler)
    server.seen, server.sent, server.gone, server.gate = [], 0, threading.Event(), threading.Event()
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def front(upstream):
    limits = HttpFrontLimits(max_body_mb=1, max_header_kb=4, header_seconds=1, idle_seconds=2, max_connections=4,
                             max_unsent_mb=2, max_unsent_seconds=1)  # fmt: skip
    f = HttpFront("127.0.0.1", free_port(), upstream.server_address, limits).start()
    yield f
    f.close()


def post(front, path, body=b"", headers=None, conn=None):
    conn = conn or http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    chunked = "transfer-encoding" in (headers or {})
    conn.request("POST", path, body=body, headers=headers or {}, encode_chunked=chunked)
    r = conn.getresponse()
    return r.status, r.read(), conn


def accepted_so_far(front, upstream) -> int:
    """Connections the upstream has accepted, every one the front opened so far included: a probe through the
    front on a connection of its own is answered only once the upstream accepted it, after every earlier one."""
    status, _, conn = post(front, "/probe")
    conn.close()
    assert status == 200
    return upstream.accepted


def wait_closed(sock: socket.socket, seconds: float) -> bool:
    """True if the front closes ``sock`` within ``seconds`` (EOF or reset)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_forwards_requests_on_a_kept_alive_connection(front, upstream):
    status, body, conn = post(front, "/echo", b"x" * 1000, {"x-probe": "mine", "connection": "keep-alive, x-hop",
                                                             "x-hop": "dropped"})  # fmt: skip
    assert status == 200 and json.loads(body) == {"path": "/echo", "bytes": 1000, "probe": "mine"}
    status, body, _ = post(front, "/again", b"y" * 10, conn=conn)  # the same connection
    assert status == 200 and json.loads(body)["bytes"] == 10
    path, headers = upstream.seen[-2]
    assert "x-hop" not in {k.lower() for k in headers}  # named by Connection: hop-by-hop
    conn.close()


def test_chunked_body_is_forwarded_and_counted(front):
    status, body, conn = post(front, "/echo", iter([b"a" * 5000, b"b" * 5000]), {"transfer-encoding": "chunked"})
    assert status == 200 and json.loads(body)["bytes"] == 10000
    status, body, conn = post(front, "/echo", iter([b"a" * 2**19] * 3), {"transfer-encoding": "chunked"})
    assert status == 413 and "--http-front-max-body-mb" in json.loads(body)["error"]


def test_oversized_body_gets_413_before_upstream(front, upstream):
    before = accepted_so_far(front, upstream)
    status, body, _ = post(front, "/oversized", b"z" * (2**20 + 1))
    assert status == 413 and "--http-front-max-body-mb" in json.loads(body)["error"]
    assert accepted_so_far(front, upstream) == before + 1  # the probe's: the front never opened one for it


def test_large_head_gets_431(front):
    status, body, _ = post(front, "/echo", b"", {"x-big": "h" * 8000})
    assert status == 431 and "--http-front-max-header-kb" in json.loads(body)["error"]


def test_unfinished_head_is_closed(front, upstream):
    before = len(upstream.seen)
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # never the blank line
        assert wait_closed(s, 10)
    with socket.create_connection(("127.0.0.1", front.port)) as s:  # kept alive, then idle
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert wait_closed(s, 10)
    assert len(upstream.seen) == before + 1


def test_stream_arrives_chunk_by_chunk(front):
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    conn.request("POST", "/stream", body=b"3")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
    assert r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_each_event_is_passed_on_as_it_comes(front, upstream):
    """The second event is sent only once the client has read the first through the front: a front that
    held the response back would get ``late`` instead."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    conn.request("POST", "/gated", body=b"")
    r = conn.getresponse()
    assert r.read1(100) == b"data: 0\n\n"
    upstream.gate.set()
    assert r.read() == b"data: 1\n\n"


def test_client_that_never_reads_is_cut(front, upstream):
    cuts = LAUNCHER.values[CUT_COUNTER]
    upstream.gone.clear()
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert upstream.gone.wait(20)  # the upstream's response ended with the connection
    assert LAUNCHER.values[CUT_COUNTER] == cuts + 1
    status, body, _ = post(front, "/echo", b"ok")  # the front still serves
    assert status == 200


def test_a_client_that_leaves_ends_the_upstream_response(front, upstream):
    upstream.gone.clear()
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    conn.request("POST", "/stream", body=b"")
    r = conn.getresponse()
    assert r.read1(100).startswith(b"data: 0")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert upstream.gone.wait(20)


def test_connections_past_the_bound_get_503(front):
    socks = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(4)]
    try:
        wait_until_true(lambda: len(front.clients) == 4)  # the front took them all
        extra = socket.create_connection(("127.0.0.1", front.port))
        extra.settimeout(5)
        assert extra.recv(1000).startswith(b"HTTP/1.1 503")
        extra.close()
    finally:
        for s in socks:
            s.close()


def test_forwarded_headers_drop_hop_by_hop():
    headers = [(b"Connection", b"close, X-A"), (b"x-a", b"1"), (b"te", b"trailers"), (b"x-b", b"2"),
               (b"transfer-encoding", b"chunked"), (b"admin-key", b"k")]  # fmt: skip
    assert forwarded_headers(headers) == [(b"x-b", b"2"), (b"admin-key", b"k")]
    assert forwarded_headers(headers, keep_framing=True)[-1] == (b"transfer-encoding", b"chunked")


def test_expect_100_continue_gets_the_upstreams_100_or_the_bound_before_any_body(front, upstream):
    """A client that waits for ``100 Continue`` before its body: it gets the upstream's 100 through the front,
    then the answer; a body past the bound gets 413 at once, before the client sent a byte of it."""
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.settimeout(30)
        s.sendall(head % 5)
        assert s.recv(1000) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"hello")
        answer = b""
        while not answer.endswith(b"}"):
            answer += s.recv(1000)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'"bytes": 5, "probe": null}')
    before = accepted_so_far(front, upstream)
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.settimeout(30)
        s.sendall(head % (2**20 + 1))
        assert s.recv(1000).startswith(b"HTTP/1.1 413 ")
    assert accepted_so_far(front, upstream) == before + 1  # the probe's only


def test_a_body_that_stops_coming_is_closed_after_idle_seconds(front):
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)  # 90 bytes short
        assert wait_closed(s, 30)


def test_a_kept_alive_client_is_served_after_the_upstream_closed_the_fronts_connection(front):
    """Triton restarted between two requests of a kept-alive client: the front's connection to it is gone,
    and the next request goes on a new one (not on the dead one, which would end the client's with a reset)."""
    status, _, conn = post(front, "/echo", b"1")
    assert status == 200
    (client,) = [c for c in front.clients if c.up is not None]
    front.loop.call_soon_threadsafe(client.up[1].transport.abort)  # what Triton's end looks like to the front
    wait_until_true(lambda: client.up is None or client.up[0].at_eof())
    status, body, _ = post(front, "/echo", b"22", conn=conn)
    assert status == 200 and json.loads(body)["bytes"] == 2
    conn.close()


def wait_until_true(done, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.05)
