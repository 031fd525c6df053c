"""ElevenLabs' multi-stream-input socket through a real gateway and server, as a protocol-level client: the
turns LiveKit's and Pipecat's ElevenLabs services send (tests/fixtures/elevenlabs_plugins.py:
livekit-plugins-elevenlabs 1.8.9, pipecat-ai 1.14.0) get the audio of the same pieces sent as a text-in
stream over gRPC, alignment that covers it, and one isFinal; a barge-in (close_context mid-speech) frees the
slot and pages while another context on the socket finishes; each bound is refused by name.

The one change to the clients' messages: our ``seed`` and ``parameters`` extensions on a context's first
message (the test checkpoint never stops by itself, so a segment lasts max_patches).
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import websocket

from client.aio import AsyncTTSClient
from client.text_in import Flushed
from gateway.server import in_thread
from gateway.socket_bounds import SocketBounds
from tests.fixtures.elevenlabs_plugins import CONTEXT, HANDSHAKES, SCENARIOS, SENTENCES
from tests.integration.helpers import wait_gauges_zero
from tests.integration.test_agent_socket_server import SHORT
from tests.integration.test_agent_socket_server import Socket as CartesiaSocket

pytestmark = pytest.mark.integration
LONG = {"max_patches": 400, "chunk_first": 1, "chunk_next": 1, "chunk_fixed": True}


class Socket:
    """One client socket on multi-stream-input, with a client's handshake (voice ``default``)."""

    def __init__(self, gateway: str, client: str = "pipecat", timeout: float = 60.0, **query):
        hs = HANDSHAKES[client]
        query = {**hs.query, "output_format": "pcm_24000", **query}
        path = hs.path.replace("<voice id>", "default")
        url = gateway.replace("http", "ws", 1) + path + "?" + "&".join(f"{k}={v}" for k, v in query.items())
        self.ws = websocket.create_connection(url, header=hs.headers, timeout=timeout)

    def send(self, message: dict) -> None:
        self.ws.send(json.dumps(message))

    def receive(self) -> dict:
        return json.loads(self.ws.recv())

    def until_final(self, context_id: str = CONTEXT) -> list[dict]:
        replies = []
        while not (replies and replies[-1].get("isFinal") and replies[-1].get("contextId") == context_id):
            replies.append(self.receive())
        return replies

    def close(self) -> None:
        self.ws.close()


def ours(sends: list[dict], parameters: dict = SHORT, **changes) -> list[dict]:
    """A client's messages with our extensions on the first."""
    return [{**sends[0], "seed": 7, "parameters": parameters, **changes}] + [{**m, **changes} for m in sends[1:]]


def audio_of(replies: list[dict], context_id: str = CONTEXT) -> np.ndarray:
    data = b"".join(base64.b64decode(r["audio"]) for r in replies if r.get("audio") and r["contextId"] == context_id)
    return np.frombuffer(data, "<i2")


async def text_in(grpc: str, pieces: list[tuple[str, bool]]) -> np.ndarray:
    """The same pieces as a text-in stream over gRPC, as 16-bit steps."""
    async with AsyncTTSClient(grpc) as tts:
        stream = await tts.open_text(language=None, seed=7, parameters=SHORT)
        for text, flush in pieces:
            await stream.send(text, flush=flush)
        await stream.end()
        audio = [item.audio for item in [x async for x in stream] if not isinstance(item, Flushed)]
    return np.round(np.clip(np.concatenate(audio), -1, 1) * 32767)


@pytest.mark.parametrize("client", ["livekit", "pipecat"])
def test_a_frameworks_turn_sounds_as_the_same_text_in_stream_with_alignment_covering_it(gateway, server, client):
    turn = next(s for s in SCENARIOS if s.client == client and s.ends_with_audio)
    sock = Socket(gateway, client)
    try:
        for message in ours(turn.sends):
            sock.send(message)
        replies = sock.until_final()
    finally:
        sock.close()
    assert not [r for r in replies if "error" in r], replies
    assert sum(bool(r.get("isFinal")) for r in replies) == 1
    pieces = [(" ", False)] + [(s, True) for s in SENTENCES] + [("", True)]  # what both become (unit tests)
    expected = asyncio.run(text_in(f"127.0.0.1:{server.ports.grpc}", pieces))
    got = audio_of(replies)
    assert got.size == expected.size and np.max(np.abs(got - expected)) <= 1
    clock, chars = 0.0, []  # each message's times from its start (as Pipecat reads them): they tile the audio
    for r in replies:
        if r.get("alignment"):
            a = r["alignment"]
            assert a["charStartTimesMs"] == sorted(a["charStartTimesMs"]) and min(a["charDurationsMs"]) >= 0
            chars += a["chars"]
            clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    assert "".join(chars).split() == "".join(SENTENCES).split()
    assert clock == pytest.approx(1000 * got.size / 24000, abs=5)


def test_the_same_text_on_the_cartesia_socket_sounds_the_same(gateway, server):
    """One core under both vendors: the same units, the same seed, the same audio."""
    sock = Socket(gateway, "livekit")
    try:
        for message in ours(next(s for s in SCENARIOS if s.client == "livekit").sends):
            sock.send(message)
        eleven = audio_of(sock.until_final())
    finally:
        sock.close()
    cartesia = CartesiaSocket(gateway, "pipecat")
    base = {"context_id": "c", "voice": {"mode": "id", "id": "default"}, "seed": 7, "parameters": SHORT,
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}  # fmt: skip
    try:
        cartesia.send({**base, "transcript": " ", "continue": True, "max_buffer_delay_ms": 5000})
        for s in SENTENCES:
            cartesia.send({**base, "transcript": s, "continue": True, "max_buffer_delay_ms": 0})
        cartesia.send({**base, "transcript": "", "continue": False})
        replies = cartesia.until_done("c")
    finally:
        cartesia.close()
    data = b"".join(base64.b64decode(r["data"]) for r in replies if r["type"] == "chunk")
    theirs = np.frombuffer(data, "<i2")
    assert theirs.size == eleven.size and np.max(np.abs(theirs.astype(int) - eleven)) <= 1


def test_barge_in_frees_the_slot_and_pages_while_another_context_goes_on(gateway, server):
    interrupted = next(s for s in SCENARIOS if s.client == "pipecat" and not s.ends_with_audio).sends
    other = next(s for s in SCENARIOS if s.client == "pipecat" and s.ends_with_audio).sends
    sock = Socket(gateway, "pipecat")
    try:
        for message in ours(interrupted[:-1], LONG):  # 400 patches: still speaking when interrupted
            sock.send(message)
        first = sock.receive()
        assert first.get("audio") and first["contextId"] == CONTEXT
        for message in ours(other, context_id="other"):
            sock.send(message)
        sock.send(interrupted[-1])  # close_context after a sentence: Pipecat's interruption
        replies = sock.until_final("other")
        mine = [r for r in replies if r.get("contextId") == CONTEXT]
        assert mine and mine[-1] == {"isFinal": True, "contextId": CONTEXT}
        assert audio_of(replies, "other").size
        m = wait_gauges_zero(server)
        assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0
        assert m["tts_vocoder_active_streams"] == 0
    finally:
        sock.close()


@pytest.fixture(scope="module")
def tight(server):
    """A gateway whose agent-socket bounds a test reaches in a second or two."""
    bounds = SocketBounds(sockets=2, contexts=2, messages_per_second=1, message_burst=10, idle_seconds=30,
                          context_idle_seconds=30, context_chars=200)  # fmt: skip
    with in_thread(f"127.0.0.1:{server.ports.grpc}", socket_bounds=bounds) as url:
        yield url


def first_error(sock: Socket) -> dict:
    reply = sock.receive()
    while "error" not in reply:
        reply = sock.receive()
    return reply


def test_contexts_characters_and_messages_are_refused_by_name(tight, server):
    sock = Socket(tight)
    try:
        for i in range(3):
            sock.send({"text": "Waiting for", "context_id": f"c{i}", "seed": 7, "parameters": SHORT})
        contexts = first_error(sock)
        sock.send({"text": "x" * 201, "context_id": "c0"})
        chars = first_error(sock)
        for _ in range(10):
            sock.send({"text": "", "context_id": "c1"})
        messages = first_error(sock)
    finally:
        sock.close()
    assert contexts["error"].startswith("too many contexts: a socket has at most 2") and contexts["contextId"] == "c2"
    assert chars["error"].startswith("context text too long") and chars["code"] == 413
    assert messages["error"].startswith("too many messages: a socket takes at most 1 a second")
    assert messages["code"] == 429 and messages["status"] == "too_many_requests"
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


def test_inactivity_timeout_ends_an_idle_context_then_the_socket_by_name(gateway, server):
    sock = Socket(gateway, inactivity_timeout=1, auto_mode="false")  # its text waits for more
    try:
        sock.send({"text": "Waiting for", "context_id": "c1", "seed": 7, "parameters": SHORT})
        replies = [sock.receive() for _ in range(3)]
        closed = sock.ws.recv_data()
    finally:
        sock.close()
    assert "error" in replies[0], replies
    assert replies[0]["error"].startswith("context idle: no text for 1 s") and replies[0]["contextId"] == "c1"
    assert replies[1] == {"isFinal": True, "contextId": "c1"} and replies[2]["error"].startswith("socket idle")
    assert closed[0] == websocket.ABNF.OPCODE_CLOSE
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


def test_sockets_of_both_vendors_share_the_bound(tight):
    open_ = [CartesiaSocket(tight), Socket(tight)]
    try:
        third = Socket(tight)
        refused = third.receive()
        closed = third.ws.recv_data()
        third.close()
    finally:
        for sock in open_:
            sock.close()
    assert refused["error"].startswith("too many sockets: the server has 2") and refused["code"] == 503
    assert closed[0] == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(closed[1][:2], "big") == 1013
