"""What one agent-socket client can hold, against a real gateway and tritonserver (issue 47, rows 1 and 2):
a socket whose client never reads is cut at the unsent-audio bound (all its contexts together) with its
slots freed and tritonserver's memory flat; sockets that never read do not keep the socket places; one address
gets a share of the places; and an OpenAI stream cut by a server that went away mid-stream is one log line, not
a traceback. After each attack a legitimate socket context and a whole-text gRPC request sound as before. (The
default context idle bound's 408 comes before the server's 400: tests/unit/test_agent_socket.py.)"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import websocket

from client import TTSClient
from gateway.budget import Bounds
from gateway.server import ServerOptions, in_thread
from gateway.socket_bounds import SocketBounds
from tests.integration.helpers import metrics, wait_gauges_zero
from tests.integration.test_agent_socket_server import GOOD, SHORT, Socket, audio_of

pytestmark = pytest.mark.integration
UNSENT_SECONDS = 2.0
SEND_SECONDS = 2.0
# 800 patches a context (128 s of audio, 12 MB of float32): unread, tritonserver kept it all (issue 47: 4.3 MB/s).
# Chunks of 50 patches (8 s): the stream's pacing lead (2 x 8 s) is above the unsent bound, which is what
# ends it here (with chunks smaller than the bound the server pauses the stream first: test_pacing_server)
LONG = {"max_patches": 800, "chunk_first": 1, "chunk_next": 50, "chunk_fixed": True}
F32 = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 48000}  # the fattest output: buffers fill first
RSS_MARGIN_MB = 20  # four such contexts unread grew tritonserver by ~50 MB before the bound
LEGIT_TEXT = "A legitimate request."


def rss_mb(server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def non_reader(url: str, contexts: int) -> websocket.WebSocket:
    """A socket with a small receive window that opens ``contexts`` long contexts and never reads."""
    opts = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]  # before connecting: a small window
    ws = websocket.create_connection(url.replace("http", "ws", 1) + "/tts/websocket", timeout=10, sockopt=opts)
    for i in range(contexts):
        ws.send(json.dumps({**GOOD, "context_id": f"n{i}", "parameters": LONG, "output_format": F32,
                            "transcript": "Nobody reads this one. " * 4}))  # fmt: skip
    return ws


def legit(url: str, server) -> tuple[bytes, np.ndarray]:
    """A socket context's bytes and a whole-text gRPC request's audio (both seeded)."""
    sock = Socket(url)
    try:
        sock.send({**GOOD, "transcript": LEGIT_TEXT, "parameters": SHORT, "seed": 7})
        replies = sock.until_done("c1")
    finally:
        sock.close()
    assert "error" not in [r["type"] for r in replies], replies
    grpc = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize(LEGIT_TEXT, seed=7, parameters=SHORT)
    return audio_of(replies, "c1"), grpc


def wait_for_log(caplog, text: str, timeout: float, server) -> None:
    deadline = time.monotonic() + timeout
    while text not in caplog.text:
        assert time.monotonic() < deadline, (caplog.text, metrics(server))
        time.sleep(0.2)


def assert_freed(server) -> None:
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0
    assert m["tts_vocoder_active_streams"] == 0


@pytest.fixture(scope="module")
def unsent(server):
    """A gateway whose unsent-audio bound a test reaches in a second (its send bound out of the way)."""
    options = ServerOptions(bounds=Bounds(unsent_seconds=UNSENT_SECONDS))
    with in_thread(f"127.0.0.1:{server.ports.grpc}", socket_bounds=SocketBounds(send_seconds=120),
                   options=options) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def tight(server):
    """A gateway of 3 agent sockets, 2 from one address, whose sends must progress within 2 s."""
    bounds = SocketBounds(sockets=3, sockets_per_peer=2, send_seconds=SEND_SECONDS)
    with in_thread(f"127.0.0.1:{server.ports.grpc}", socket_bounds=bounds) as url:
        yield url


def test_a_socket_that_never_reads_is_cut_at_the_unsent_bound_and_frees_everything(unsent, server, caplog):
    before = legit(unsent, server)
    rss_before = rss_mb(server)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        ws = non_reader(unsent, 4)  # the session server's 4 slots
        try:
            wait_for_log(caplog, "cut: not reading: its client left", 60, server)
            assert_freed(server)
            rss_after = rss_mb(server)
            ws.settimeout(10)  # the socket was aborted: what the client had not read, then a reset or an end
            with pytest.raises((websocket.WebSocketException, OSError)) as ended:
                while True:
                    ws.recv()
            assert not isinstance(ended.value, websocket.WebSocketTimeoutException)
        finally:
            ws.sock and ws.sock.close()
    lines = [r.getMessage() for r in caplog.records if "agent socket" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("an agent socket from 127.0.0.1:"), lines
    print(f"tritonserver RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    assert rss_after - rss_before < RSS_MARGIN_MB
    after = legit(unsent, server)
    assert after[0] == before[0] and np.array_equal(after[1], before[1])


def test_sockets_that_never_read_do_not_keep_the_socket_places(tight, server, caplog):
    before = legit(tight, server)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        held = [non_reader(tight, 1) for _ in range(2)]  # this address's whole share
        try:
            refused = Socket(tight)
            assert refused.receive()["error"].startswith("too many sockets from your address")
            refused.close()
            t0 = time.monotonic()
            # each is cut once a reply has waited SEND_SECONDS (or its unsent audio passed the bound)
            while caplog.text.count("cut: not reading") < 2:
                assert time.monotonic() - t0 < SEND_SECONDS + 30, (caplog.text, metrics(server))
                time.sleep(0.2)
        finally:
            for ws in held:
                ws.sock and ws.sock.close()
    assert_freed(server)
    assert legit(tight, server)[0] == before[0]  # a new socket is accepted and sounds as before


def test_one_address_gets_its_share_of_the_sockets_by_name(tight):
    mine = [Socket(tight), Socket(tight)]
    try:
        third = Socket(tight)  # the gateway's bound (3) would take it; this address's share (2) does not
        refused = third.receive()
        closed = third.ws.recv_data()
        third.close()
        mine.pop().close()
        time.sleep(0.5)  # the gateway sees the close
        again = Socket(tight)
        again.send({**GOOD, "parameters": SHORT})
        assert again.receive()["type"] == "chunk"
        again.close()
    finally:
        for sock in mine:
            sock.close()
    assert refused["error"].startswith("too many sockets from your address: at most 2") and refused["context_id"] == ""
    assert refused["status_code"] == 503
    assert closed[0] == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(closed[1][:2], "big") == 1013


class CuttingProxy:
    """A TCP proxy to ``target`` (host, port) on a free loopback port; :meth:`cut` closes every
    connection through it at once, as a server that restarts does."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.conns = target, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.conns = []

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_an_openai_stream_cut_by_the_server_going_away_is_one_log_line(server, caplog):
    proxy = CuttingProxy(("127.0.0.1", server.ports.grpc))
    body = {"model": "fireredtts3", "input": "This stream is cut.", "response_format": "pcm",
            "max_patches": 400, "chunk_first": 1, "chunk_next": 1, "chunk_fixed": True}  # fmt: skip
    uvicorn_log = logging.getLogger("uvicorn")  # its own handlers, not propagated: caplog's is added to them
    gateways = {t for t in threading.enumerate() if t.name == "gateway"}  # the module's, which stay
    try:
        with in_thread(proxy.address) as url, caplog.at_level(logging.INFO):
            uvicorn_log.addHandler(caplog.handler)  # (once started: uvicorn's logging config sets its handlers)
            got = b""
            with pytest.raises(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/audio/speech", json=body,
                                                              timeout=30) as r:  # fmt: skip
                assert r.status_code == 200
                for part in r.iter_bytes():
                    got += part
                    if len(got) > 100_000:  # audio is flowing: the server goes away
                        proxy.cut()
            wait_for_log(caplog, "cut: the stream failed after its start", 30, server)
    finally:  # (leaving in_thread waits for the gateway's requests to end: anything it logs after the cut is in)
        uvicorn_log.removeHandler(caplog.handler)
        proxy.close()
    assert not {t for t in threading.enumerate() if t.name == "gateway"} - gateways  # it ended, its requests too
    assert 0 < len(got) < 400 * 3840 * 2  # a broken answer, not a complete-looking one
    cut = [r for r in caplog.records if "cut: the stream failed after its start" in r.getMessage()]
    assert len(cut) == 1 and cut[0].getMessage().startswith("a speech stream from 127.0.0.1:"), caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text  # no traceback
    assert "Exception in ASGI application" not in caplog.text
    assert_freed(server)
