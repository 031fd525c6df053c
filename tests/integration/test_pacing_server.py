"""Pacing against a real server (serving.flow.pacing): a paced request whose client takes nothing is paused
once it is a lead ahead and ended at the hold bound; one whose client reads slowly is paused and resumed and
its audio is bit for bit an unpaced request's; a pace request with a token nobody holds is refused by name."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from client import AsyncTTSClient, TTSError
from client.pace import Pace, pace_request
from engine.chunking import PATCH_SECONDS
from engine.protocol import SAMPLE_RATE
from serving.flow.receipts import ReceiptBoard
from tests.integration.helpers import wait_gauges_zero

pytestmark = pytest.mark.integration

# chunk_next 3: a lead of 2 x 3 x 0.16 = 0.96 s; fixed chunks: bit for bit comparable (their sizes move
# float32 rounding); 40 patches: 6.4 s of audio
PARAMS = {"max_patches": 40, "chunk_first": 2, "chunk_next": 3, "chunk_fixed": True}
LEAD = 2 * 3 * PATCH_SECONDS
TEXT = "Paced speech for a listener."


def url(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


async def collect(server, **kw) -> tuple[list[np.ndarray], Exception | None]:
    """The chunks of one request (reading each after ``delay`` s; ``parameters``: PARAMS), and the error that
    ended it, if any."""
    delay, params = kw.pop("delay", 0.0), kw.pop("parameters", PARAMS)
    chunks, error = [], None
    async with AsyncTTSClient(url(server), timeout=60) as tts:
        try:
            async for chunk in tts.stream(TEXT, seed=3, parameters=params, **kw):
                chunks.append(chunk.audio)
                await asyncio.sleep(delay)
        except TTSError as e:
            error = e
    return chunks, error


@pytest.fixture(scope="module")
def unpaced(server) -> np.ndarray:
    chunks, error = asyncio.run(collect(server))
    assert error is None
    audio = np.concatenate(chunks)
    assert audio.size == 40 * PATCH_SECONDS * SAMPLE_RATE
    return audio


def held_streams(server_options) -> ReceiptBoard:
    """tts's board (serving.flow.receipts) as the generator sees it: the streams its pacers hold."""
    board = ReceiptBoard(server_options.cancel_dir)
    assert board.entry("tts:0") is not None  # (opens the board)
    return board


def stream_steps(server) -> float:
    return server.metrics(("tts_generator_stream_steps_total",))["tts_generator_stream_steps_total"]


def test_a_client_that_takes_nothing_is_paused_at_the_lead_then_ended(server, unpaced):
    before = stream_steps(server)
    t0 = time.monotonic()
    chunks, error = asyncio.run(collect(server, pace=Pace()))  # a pace that never reports anything taken
    took = time.monotonic() - t0
    sent = sum(c.size for c in chunks) / SAMPLE_RATE
    made = (stream_steps(server) - before - 1) * PATCH_SECONDS  # (its first step is the prefill)
    print(f"non-reader: sent {sent:.2f} s, made {made:.2f} s of {unpaced.size / SAMPLE_RATE:.2f} s; "
          f"lead {LEAD:.2f} s; ended after {took:.1f} s")  # fmt: skip
    assert error is not None and "took no audio for 4 s" in str(error) and "pace-hold-seconds" in str(error)
    assert LEAD < sent <= LEAD + 3 * PATCH_SECONDS + 1e-6  # the lead and one chunk
    assert made <= LEAD + 2 * 3 * PATCH_SECONDS + 1e-6  # and the next chunk's patches, at most
    again, error = asyncio.run(collect(server))  # its slot and pages are free, the server as before
    assert error is None and np.array_equal(np.concatenate(again), unpaced)


def test_a_slow_reader_is_paced_and_gets_the_same_audio(server, server_options, unpaced):
    """The reader takes a 0.48 s chunk every 0.3 s (the tiny model makes one far sooner): its streams are
    paused and resumed, and its audio is that of the unpaced request. A forged pace request meanwhile (a
    token no request holds) is refused by name and touches nothing."""
    marks, stop = set(), threading.Event()
    board = held_streams(server_options)

    def watch() -> None:
        while not stop.is_set():
            marks.update(board.held())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def both():
        forged = asyncio.ensure_future(forge(server))
        got = await collect(server, pace=True, delay=0.3)
        return got, await forged

    try:
        (chunks, error), forged = asyncio.run(both())
    finally:
        stop.set()
        watcher.join()
    assert error is None
    assert np.array_equal(np.concatenate(chunks), unpaced)
    assert marks, "the stream was never paused"
    assert not board.held()  # no hold outlives its request
    assert "no running request has this pace token" in forged


def test_a_reader_slower_than_real_time_is_not_a_late_listener(server):
    """A paced reader at half real time (a 0.32 s chunk each 0.6 s) is paused at its lead again and again;
    each resumed chunk finds its listener dry by the server's clock, but it was its client's own pause, not the
    server's lateness: the start window counts no late chunk and stays at least its start (32 places). Counted,
    one slow reader would back the window off every lag and hold back everyone's starts."""
    names = ("tts_start_late_chunks_total", "tts_start_window")
    before = server.metrics(names)
    params = {"max_patches": 16, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}  # a 0.64 s lead
    chunks, error = asyncio.run(collect(server, pace=True, delay=0.6, parameters=params))
    after = server.metrics(names)
    assert error is None and len(chunks) == 8
    assert after["tts_start_late_chunks_total"] == before["tts_start_late_chunks_total"]
    assert after["tts_start_window"] >= 32


async def forge(server) -> str:
    """A pace request with a token nobody holds, on a stream of its own: its error message."""
    from tritonclient.grpc import aio

    await asyncio.sleep(0.5)
    client = aio.InferenceServerClient(url(server))
    try:

        async def one():
            yield pace_request("tts", "forged-token-of-nobody", 1e6)

        async for result, error in client.stream_infer(one()):
            return str(error) if error is not None else f"answered: {result.get_response()}"
        return "no answer"
    finally:
        await client.close()


def test_a_speech_client_that_stops_reading_stops_the_generator(server, server_options, gateway):
    """Through the gateway (the speech route): a client that reads the headers and then nothing more, on a
    socket with a small receive buffer. The generator stops making its audio once the gateway's buffers and
    the lead are full, long before the gateway's unsent bound (30 s) would have cut it, and the request ends
    at the hold bound (4 s here) with its slot freed while the client is still connected."""
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps({"input": "A listener who left the room.", "response_format": "pcm", "seed": 5,
                       "max_patches": 300, "chunk_first": 3, "chunk_next": 6, "chunk_fixed": True}).encode()  # fmt: skip
    before = stream_steps(server)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: the window stays small)
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        made, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:  # until the generator has made nothing for 2 s
            time.sleep(0.5)
            made.append(stream_steps(server) - before)
            if len(made) > 4 and made[-1] == made[-5]:
                break
        seconds = (made[-1] - 1) * PATCH_SECONDS
        print(f"speech route, client not reading: the generator made {seconds:.1f} s of 48 s, then stopped "
              f"(lead {2 * 6 * PATCH_SECONDS:.2f} s)")  # fmt: skip
        assert made[-1] == made[-5] and seconds < 20  # stopped, far short of the 30 s bound and the 48 s
        m = wait_gauges_zero(server, timeout=30)  # held out: ended, its slot freed, the client still there
        assert m["tts_generator_active_slots"] == 0 and not held_streams(server_options).held()
    finally:
        sock.close()


async def text_in(server, pace, delay: float = 0.0) -> tuple[list[np.ndarray], Exception | None]:
    """A text-in stream (its text in three pieces), read with ``delay`` s per chunk."""
    chunks, error = [], None
    async with AsyncTTSClient(url(server), timeout=60) as tts:
        try:
            async for chunk in tts.stream_text(["Paced text ", "comes in ", "pieces."], seed=3, parameters=PARAMS,
                                               pace=pace):  # fmt: skip
                chunks.append(chunk.audio)
                await asyncio.sleep(delay)
        except TTSError as e:
            error = e
    return chunks, error


def test_a_text_in_stream_is_paced_alike(server):
    """gRPC text-in: a slow reader's audio is an unpaced stream's, bit for bit; a stream whose pace reports
    nothing taken is ended at the hold bound, having been sent no more than the lead and a chunk."""
    unpaced, error = asyncio.run(text_in(server, None))
    assert error is None
    slow, error = asyncio.run(text_in(server, True, delay=0.3))
    assert error is None and np.array_equal(np.concatenate(slow), np.concatenate(unpaced))
    held, error = asyncio.run(text_in(server, Pace()))
    assert error is not None and "took no audio" in str(error)
    assert sum(c.size for c in held) / SAMPLE_RATE <= LEAD + 3 * PATCH_SECONDS + 1e-6
