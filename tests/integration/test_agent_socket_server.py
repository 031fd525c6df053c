"""The agent WebSocket (/tts/websocket) through a real gateway and server, as a protocol-level client: the
message sequences LiveKit's and Pipecat's Cartesia plugins send (tests/fixtures/cartesia_plugins.py:
livekit-plugins-cartesia 1.8.9, pipecat-ai 1.14.0), with their handshakes, get audio and one done; a cancel
mid-segment frees the slot and pages while another context on the socket finishes; refusals are named; and
mu-law at 8 kHz decodes back to the tts model's audio within the codec's error.

The one change to the plugins' messages: our ``parameters`` extension keeps each segment short (the test
checkpoint never stops by itself, so a segment lasts max_patches).
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import soxr
import websocket  # websocket-client: a plain synchronous client, nothing of the server's code

from client import TTSClient
from gateway.rates import QUALITY
from gateway.server import in_thread
from gateway.socket_bounds import SocketBounds
from tests.fixtures.cartesia_plugins import CONTEXT, HANDSHAKES, SCENARIOS, SENTENCES, pipecat_generation
from tests.integration.helpers import wait_gauges_zero
from tests.unit.test_g711 import mulaw_decode

pytestmark = pytest.mark.integration
SHORT = {"max_patches": 4, "chunk_first": 1, "chunk_next": 2, "chunk_fixed": True}


class Socket:
    """One client socket: JSON out, JSON in (each receive waits at most ``timeout`` seconds)."""

    def __init__(self, gateway: str, plugin: str = "livekit", timeout: float = 60.0):
        hs = HANDSHAKES[plugin]
        query = "&".join(f"{k}={v}" for k, v in hs.query.items())
        url = gateway.replace("http", "ws", 1) + hs.path + (f"?{query}" if query else "")
        self.ws = websocket.create_connection(url, header=hs.headers, timeout=timeout)

    def send(self, message) -> None:
        self.ws.send(message if isinstance(message, str) else json.dumps(message))

    def receive(self) -> dict:
        return json.loads(self.ws.recv())

    def until_done(self, context_id: str) -> list[dict]:
        replies = []
        while not (replies and replies[-1]["type"] == "done" and replies[-1]["context_id"] == context_id):
            replies.append(self.receive())
        return replies

    def close(self) -> None:
        self.ws.close()


def ours(message: dict, **changes) -> dict:
    """A plugin's message for this server: the default voice, short segments."""
    if "voice" in message:
        message = {**message, "voice": {**message["voice"], "id": "default"}, "parameters": SHORT, "seed": 7}
    return {**message, **changes}


def audio_of(replies: list[dict], context_id: str = CONTEXT) -> bytes:
    return b"".join(
        base64.b64decode(r["data"]) for r in replies if r["type"] == "chunk" and r["context_id"] == context_id
    )


ENDING = [s for s in SCENARIOS if s.sends[-1].get("continue") is False and len({m["context_id"] for m in s.sends}) == 1]


@pytest.mark.parametrize("scenario", ENDING[:1] + [s for s in ENDING if s.plugin == "pipecat"][:1],
                         ids=lambda s: s.plugin)  # fmt: skip
def test_a_plugins_reply_comes_back_as_audio_words_and_one_done(gateway, server, scenario):
    sock = Socket(gateway, scenario.plugin)
    try:
        sock.send(ours(scenario.sends[0]))
        replies = [sock.receive()]
        while replies[-1]["type"] != "chunk":  # the first sentence is heard before the next is sent
            replies.append(sock.receive())
        for message in scenario.sends[1:]:
            sock.send(ours(message))
        replies += sock.until_done(CONTEXT)
    finally:
        sock.close()
    assert [r["type"] for r in replies].count("done") == 1 and all(r["context_id"] == CONTEXT for r in replies)
    assert "error" not in [r["type"] for r in replies], replies
    rate = scenario.sends[0]["output_format"]["sample_rate"]
    texts = [m["transcript"] for m in scenario.sends]
    # the same pieces as a text-in stream over gRPC, each flushed (the plugins' messages have
    # max_buffer_delay_ms 0): its audio, resampled whole and made 16-bit, is what the socket sent
    tts = TTSClient(f"127.0.0.1:{server.ports.grpc}")
    streamed = [c.audio for c in tts.stream_text(texts, flush=True, language="English", seed=7, parameters=SHORT)]
    resampled = soxr.resample(np.concatenate(streamed), 24000, rate, quality=QUALITY)
    expected = np.round(np.clip(resampled, -1, 1) * 32767)
    got = np.frombuffer(audio_of(replies), "<i2")
    assert got.size == expected.size and np.max(np.abs(got - expected)) <= 1
    sentences = [t for t in texts if t.strip()]
    words = [w for r in replies if r["type"] == "timestamps" for w in r["word_timestamps"]["words"]]
    assert words == " ".join(sentences).split()


def test_pipecats_token_mode_word_by_word_is_cut_at_sentence_ends(gateway, server):
    """TOKEN mode: each token a message, no max_buffer_delay_ms; the server cuts at each sentence end."""
    words = " ".join(SENTENCES).split()
    pieces = [w if i == 0 else f" {w}" for i, w in enumerate(words)]
    token = {k: v for k, v in pipecat_generation("", True).items() if k != "max_buffer_delay_ms"}
    token["output_format"] = {**token["output_format"], "sample_rate": 24000}  # the model's rate, as it is
    sock = Socket(gateway, "pipecat")
    try:
        for piece in pieces:
            sock.send(ours(token, transcript=piece))
        sock.send(ours(token, transcript="", **{"continue": False}))
        replies = sock.until_done(CONTEXT)
    finally:
        sock.close()
    assert "error" not in [r["type"] for r in replies], replies
    tts = TTSClient(f"127.0.0.1:{server.ports.grpc}")
    sentences = [tts.synthesize(s.strip(), language="English", seed=7, parameters=SHORT) for s in SENTENCES]
    whole = tts.stream_text(pieces, language="English", seed=7, parameters=SHORT)
    expected = np.concatenate([c.audio for c in whole])
    got = np.frombuffer(audio_of(replies), "<i2")
    assert got.size == expected.size == sum(a.size for a in sentences) - 2 * 1200  # 3 segments, 2 cross-fades
    assert np.max(np.abs(got - np.round(np.clip(expected, -1, 1) * 32767))) <= 1


def test_mulaw_at_8_khz_decodes_back_to_the_tts_audio(gateway, server):
    text = "Your call is important to us."
    reference = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize(text, seed=7, parameters=SHORT)
    sock = Socket(gateway)
    try:
        out = {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}
        sock.send(ours(SCENARIOS[0].sends[0], transcript=text, output_format=out, **{"continue": False}))
        codes = np.frombuffer(audio_of(sock.until_done(CONTEXT)), np.uint8)
    finally:
        sock.close()
    resampled = soxr.resample(np.clip(reference, -1, 1), 24000, 8000, quality=QUALITY)
    decoded = mulaw_decode(codes) / 32767
    assert decoded.size == resampled.size
    assert np.sqrt(np.mean((decoded - resampled) ** 2)) < 0.02 * np.sqrt(np.mean(resampled**2))


def test_cancel_mid_segment_frees_the_slot_while_another_context_finishes(gateway, server):
    cancel = next(s for s in SCENARIOS if s.plugin == "pipecat" and "cancel" in s.sends[-1])
    long = {"max_patches": 400, "chunk_first": 1, "chunk_next": 1, "chunk_fixed": True}
    sock = Socket(gateway, "pipecat")
    try:
        sock.send(ours(cancel.sends[0], parameters=long))  # 400 patches: it is still speaking when cancelled
        first = sock.receive()
        assert first["type"] == "chunk" and first["context_id"] == CONTEXT
        sock.send(ours(cancel.sends[0], context_id="second", **{"continue": False}))
        sock.send(cancel.sends[1])
        replies = sock.until_done("second")
        later = [r for r in replies if r["context_id"] == CONTEXT]
        assert not [r for r in later if r["type"] in ("done", "error")]
        assert audio_of(replies, "second")
        m = wait_gauges_zero(server)
        assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0
        assert m["tts_vocoder_active_streams"] == 0
        # and it never ends: no done (a stream left running would end with one)
        sock.send(ours(cancel.sends[0], context_id="third", **{"continue": False}))
        replies += sock.until_done("third")
        assert not [r for r in replies if r["context_id"] == CONTEXT and r["type"] in ("done", "error")]
    finally:
        sock.close()


def test_closing_the_socket_cancels_its_contexts(gateway, server):
    barge_in = next(s for s in SCENARIOS if s.plugin == "livekit" and "barge-in" in s.what)
    sock = Socket(gateway, "livekit")
    sock.send(ours(barge_in.sends[0], parameters={**SHORT, "max_patches": 400}))
    assert sock.receive()["type"] == "chunk"
    sock.close()  # LiveKit's barge-in: no cancel message, the socket goes
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


GOOD = ours(SCENARIOS[0].sends[0], context_id="c1", **{"continue": False})


@pytest.mark.parametrize(
    ("messages", "named", "context"),
    [
        (["{not json"], "a message must be a JSON object", ""),
        (["x" * 70_000], "a message is at most 65536 characters", ""),
        ([b"\x01\x02"], "binary frames are not read", ""),
        ([{**GOOD, "voice": {"mode": "id", "id": "nobody"}}], "voice 'nobody' is not registered", "c1"),
        ([{**GOOD, "output_format": {**GOOD["output_format"], "sample_rate": 11025}}], "sample_rate must be one of", "c1"),
        ([{**GOOD, "parameters": {"max_patches": 0}}], "max_patches", "c1"),
        ([{**GOOD, "transcript": "word " * 3201}], "context text too long", "c1"),
        ([{**GOOD, "continue": True, "max_buffer_delay_ms": 5000, "context_id": f"c{i}"} for i in range(9)],
         "too many contexts: a socket has at most 8", "c8"),
    ],
)  # fmt: skip
def test_each_refusal_is_named_and_nothing_stays_allocated(gateway, server, messages, named, context):
    sock = Socket(gateway)
    try:
        for m in messages:
            sock.ws.send_binary(m) if isinstance(m, bytes) else sock.send(m)
        reply = sock.receive()
        while reply["type"] != "error":
            reply = sock.receive()
    finally:
        sock.close()
    assert named in reply["error"] and reply["context_id"] == context, reply
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


def test_a_lone_surrogate_in_a_transcript_is_named_then_its_context_done(gateway, server):
    """JSON carries "\\ud800", which has no UTF-8: refused by name, where it used to be dropped in silence."""
    sock = Socket(gateway)
    try:
        sock.send({**GOOD, "transcript": "Say \ud800"})  # json.dumps writes the escape, as a client can
        replies = sock.until_done("c1")
    finally:
        sock.close()
    assert [r["type"] for r in replies] == ["error", "done"], replies
    assert replies[0]["error"] == "transcript must be valid Unicode text: it contains a lone surrogate at character 4"
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


@pytest.fixture(scope="module")
def tight(server):
    """A gateway whose agent-socket bounds a test reaches in a second or two."""
    bounds = SocketBounds(sockets=2, contexts=2, messages_per_second=1, message_burst=10, idle_seconds=1,
                          context_idle_seconds=1)  # fmt: skip
    with in_thread(f"127.0.0.1:{server.ports.grpc}", socket_bounds=bounds) as url:
        yield url


def test_too_many_messages_and_contexts_are_refused_by_name(tight, server):
    sock = Socket(tight)
    try:
        held = {**GOOD, "continue": True, "max_buffer_delay_ms": 5000}
        for i in range(3):
            sock.send({**held, "context_id": f"c{i}"})
        first = sock.receive()
        for _ in range(10):
            sock.send({"context_id": "gone", "cancel": True})
        second = sock.receive()
        while second["type"] != "error":
            second = sock.receive()
    finally:
        sock.close()
    assert first["error"].startswith("too many contexts: a socket has at most 2") and first["context_id"] == "c2"
    assert second["error"].startswith("too many messages: a socket takes at most 1 a second")
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


def test_idle_contexts_and_sockets_are_ended_by_name(tight, server):
    sock = Socket(tight)
    try:
        sock.send({**GOOD, "continue": True, "max_buffer_delay_ms": 5000, "transcript": "Waiting for"})
        replies = [sock.receive() for _ in range(3)]
        closed = sock.ws.recv_data()  # the close frame: (opcode, data)
    finally:
        sock.close()
    assert [(r["type"], r["context_id"]) for r in replies] == [("error", "c1"), ("done", "c1"), ("error", "")]
    assert replies[0]["error"].startswith("context idle") and replies[2]["error"].startswith("socket idle")
    assert closed[0] == websocket.ABNF.OPCODE_CLOSE
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_kv_pages_in_use"] == 0


def test_sockets_beyond_the_gateways_bound_are_refused_by_name(tight):
    open_ = [Socket(tight), Socket(tight)]
    try:
        third = Socket(tight)
        refused = third.receive()
        closed = third.ws.recv_data()
        third.close()
    finally:
        for sock in open_:
            sock.close()
    assert refused["error"].startswith("too many sockets: the server has 2") and refused["context_id"] == ""
    assert closed[0] == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(closed[1][:2], "big") == 1013
