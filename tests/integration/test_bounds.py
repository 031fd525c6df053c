"""What a stranger can hold, against a real tritonserver (issue 30, items 3 and 4): the gateway's uploads
in flight are bounded in total (503 + Retry-After beyond), a client that stops reading its stream is cut
once it has left ``unsent_seconds`` of audio untaken and its generator slot is freed, and the metrics
relay's connections are bounded in number and time. After each attack a legitimate stream starts and
sounds as before."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from gateway.budget import Bounds
from gateway.server import ServerOptions, in_thread
from serving.fronts.metrics_relay import CONNECTION_SECONDS, MAX_CONNECTIONS
from tests.integration.helpers import metrics, wait_gauges_zero

pytestmark = pytest.mark.integration
MB = 2**20
UPLOADS_IN_FLIGHT = 3 * MB
UNSENT_SECONDS = 1.0
# fixed chunks: the bytes are compared before and after an attack
LEGIT = {"model": "fireredtts3", "input": "A legitimate stream.", "response_format": "pcm", "seed": 5,
         "max_patches": 6, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}  # fmt: skip
# 64 s of audio, 3 MB of PCM; chunks of 24 patches (3.84 s): the stream's pacing lead (7.68 s) is above the
# unsent bound, which is what ends it here (test_pacing_server: pacing stops a non-reader first)
LONG = {"input": "Nobody reads this one.", "response_format": "pcm", "max_patches": 400,
        "chunk_first": 1, "chunk_next": 24, "chunk_fixed": True}  # fmt: skip
FIRST_BYTE_SECONDS = 30.0  # max_sequence_idle, the longest a stream's step may take: a generous bound here


@pytest.fixture(scope="module")
def bounded(server):
    options = ServerOptions(bounds=Bounds(upload_bytes=UPLOADS_IN_FLIGHT, unsent_seconds=UNSENT_SECONDS))
    with in_thread(f"127.0.0.1:{server.ports.grpc}", options=options) as url:
        yield url


def legit(url: str) -> tuple[bytes, float]:
    """The legitimate stream's PCM and the seconds to its first byte."""
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=LEGIT, timeout=60) as r:
        assert r.status_code == 200, r.read()
        parts = r.iter_bytes()
        first = next(parts)
        started = time.monotonic() - t0
        return first + b"".join(parts), started


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: a small window
    sock.connect((host, int(port)))
    return sock


def test_uploads_in_flight_are_bounded_in_total(bounded):
    before, _ = legit(bounded)
    # three uploads that announce 1 MB each and send 1 KB: they hold 3 MB of the total while they trickle
    held = []
    for _ in range(3):
        sock = connect(bounded)
        sock.sendall(b"POST /v1/audio/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: %d\r\n\r\n" % MB + bytes(1024))  # fmt: skip
        held.append(sock)
    files = {"file": ("a.wav", bytes(MB // 2))}
    deadline, r = time.monotonic() + 20, None
    while time.monotonic() < deadline:  # until the server has taken the three (they are read concurrently)
        r = httpx.post(f"{bounded}/v1/audio/voices", data={"name": "v"}, files=files,
                       headers={"Authorization": "Bearer guess"}, timeout=30)  # fmt: skip
        if r.status_code == 503:
            break
        time.sleep(0.2)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "request bodies" in error["message"]
    for sock in held:
        sock.close()
    # the three are given back once their connections are gone: the same upload is read again (and refused
    # for what it is, not for the total)
    deadline = time.monotonic() + 20
    while (r := httpx.post(f"{bounded}/v1/audio/voices", data={"name": "v"}, files=files,
                           headers={"Authorization": "Bearer guess"}, timeout=30)).status_code == 503:  # fmt: skip
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text  # zeros are not audio
    after, started = legit(bounded)
    assert after == before and started < FIRST_BYTE_SECONDS


def test_a_client_that_does_not_read_is_cut_and_its_slot_freed(bounded, server, caplog):
    before, _ = legit(bounded)
    full = LONG["max_patches"] * 3840 * 2  # bytes of the whole utterance
    sock = connect(bounded, rcvbuf=4096)
    body = httpx.Request("POST", f"{bounded}/v1/audio/speech", json=LONG)
    head = "POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body.content) + body.content)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        deadline = time.monotonic() + 60  # the stream runs, then its slot is freed while the client still sits
        while "its client left" not in caplog.text:
            assert time.monotonic() < deadline, metrics(server)
            time.sleep(0.2)
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    deadline = time.monotonic() + 30  # tts ends its request after the generator's slot is free, and moves
    while m.get("tts_requests_in_flight", 0) and time.monotonic() < deadline:  # its gauges once per turn
        time.sleep(0.2)
        m = metrics(server)
    assert m.get("tts_requests_in_flight", 0) == 0
    # what reached the client before it was cut: the headers and a part of the audio, then the end
    sock.settimeout(30)
    got = b""
    try:
        while data := sock.recv(65536):
            got += data
    except ConnectionResetError:  # the gateway aborted the connection (RST): also an end
        pass
    sock.close()
    print(f"the client that did not read got {len(got)} of {full} bytes")
    assert got.startswith(b"HTTP/1.1 200") and len(got) < full // 2, len(got)
    after, started = legit(bounded)
    assert after == before and started < FIRST_BYTE_SECONDS


def test_the_metrics_relay_bounds_its_connections(server):
    idle = [socket.create_connection(("127.0.0.1", server.ports.metrics)) for _ in range(MAX_CONNECTIONS + 8)]
    for sock in idle:
        sock.settimeout(CONNECTION_SECONDS + 20)
    try:
        # each is closed unanswered: those past the bound at once, the others when their time is up
        assert [sock.recv(100) for sock in idle] == [b""] * len(idle)
    finally:
        for sock in idle:
            sock.close()
    assert "tts_generator_active_slots" in server.metrics()  # Prometheus still scrapes it
