"""ElevenLabs' sockets (gateway/dialects/elevenlabs_socket.py) without a server: the fake text stream of
test_agent_socket under the routes, the message sequences of LiveKit's and Pipecat's ElevenLabs services and
the SDK's convert_realtime (tests/fixtures/elevenlabs_plugins.py) replayed, barge-in, alignment, and every
refusal by its name in ElevenLabs' error shape."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import numpy as np
import pytest
import soxr
from starlette.testclient import TestClient

from gateway import socket_bounds
from gateway.dialects.elevenlabs_socket import ElevenLabsSocket, read_query
from gateway.rates import QUALITY
from gateway.text_socket import TextSocket
from tests.fixtures.elevenlabs_plugins import CONTEXT, HANDSHAKES, SCENARIOS, SENTENCES, VOICE_ID
from tests.unit.test_agent_socket import FakeStreams, Voices, app_for, tone
from tests.unit.test_gateway_outbox import PEER, StuckPeer

MULTI = f"/v1/text-to-speech/{VOICE_ID}/multi-stream-input"
PCM = f"{MULTI}?output_format=pcm_24000"


def url_of(client: str, **query) -> str:
    hs = HANDSHAKES[client]
    return hs.path + "?" + "&".join(f"{k}={v}" for k, v in {**hs.query, **query}.items())


def until_final(ws, context_id: str | None = CONTEXT) -> list[dict]:
    replies = []
    while not (replies and replies[-1].get("isFinal") and replies[-1].get("contextId") == context_id):
        replies.append(ws.receive_json())
    return replies


def audio_of(replies: list[dict], context_id: str | None = CONTEXT) -> bytes:
    return b"".join(
        base64.b64decode(r["audio"]) for r in replies if r.get("audio") and r.get("contextId") == context_id
    )


def check_alignment(replies: list[dict], text: str, seconds: float) -> None:
    """As Pipecat reads it: each message's times from its own start, a clock advanced by each message's span;
    the characters are the text sent, in order, and the spans cover the audio."""
    clock, chars, starts = 0.0, [], []
    for r in replies:
        if r.get("alignment"):
            a = r["alignment"]
            assert r["normalizedAlignment"] == a and len(a["chars"]) == len(a["charStartTimesMs"]) == len(
                a["charDurationsMs"]
            )
            starts += [clock + s for s in a["charStartTimesMs"]]
            chars += a["chars"]
            clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    assert "".join(chars).split() == text.split() and starts == sorted(starts)
    assert clock == pytest.approx(1000 * seconds, abs=2 * len(SENTENCES) + 2)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.ends_with_audio and s.client != "sdk"],
                         ids=lambda s: s.client)  # fmt: skip
def test_a_frameworks_turn_comes_back_as_its_sentences_audio_alignment_and_one_isfinal(scenario):
    streams = FakeStreams()
    with app_for(streams).websocket_connect(url_of(scenario.client, output_format="pcm_24000")) as ws:
        for message in scenario.sends:
            ws.send_text(json.dumps(message))
        replies = until_final(ws)
    assert all(r["contextId"] == CONTEXT for r in replies) and sum(bool(r.get("isFinal")) for r in replies) == 1
    assert not [r for r in replies if "error" in r]
    stream = streams.opened[0]
    # a sentence a unit (LiveKit flushes each; Pipecat's auto_mode speaks each), the opening space before them
    assert stream.sent == [(" ", False)] + [(s, True) for s in SENTENCES] + [("", True)] and stream.ended
    assert stream.fields == {"language": None, "voice_id": VOICE_ID}
    whole = np.concatenate([tone(1 + len(SENTENCES[0])), tone(len(SENTENCES[1]))])
    got = np.frombuffer(audio_of(replies), "<i2")
    assert np.max(np.abs(got - np.round(whole * 32767))) <= 1
    check_alignment(replies, "".join(SENTENCES), whole.size / 24000)


def test_the_sdks_convert_realtime_gets_its_audio_then_the_socket_closes():
    streams = FakeStreams()
    sdk = next(s for s in SCENARIOS if s.client == "sdk")
    with app_for(streams).websocket_connect(url_of("sdk")) as ws:
        for message in sdk.sends:
            ws.send_text(json.dumps(message))
        replies = []
        while (reply := ws.receive())["type"] == "websocket.send":
            replies.append(json.loads(reply["text"]))
    assert reply["type"] == "websocket.close" and replies[-1] == {"isFinal": True}
    assert streams.opened[0].sent == [(" ", False)] + [(s, False) for s in SENTENCES]  # no auto_mode: no flush
    mp3 = b"".join(base64.b64decode(r["audio"]) for r in replies if r.get("audio"))
    assert mp3[:3] == b"ID3" or mp3[0] == 0xFF  # mp3_44100_128, the SDK's default


@pytest.mark.parametrize("client", ["livekit", "pipecat"])
def test_barge_in_cancels_the_context_at_once_and_another_goes_on(client):
    streams = FakeStreams(hold_first=True)
    barge_in = next(s for s in SCENARIOS if s.client == client and not s.ends_with_audio)
    with app_for(streams).websocket_connect(url_of(client, output_format="pcm_24000")) as ws:
        for message in barge_in.sends[:-1]:
            ws.send_text(json.dumps(message))
        assert ws.receive_json()["audio"]  # its first sentence is heard
        other = [{**m, "context_id": "other"} for m in next(s for s in SCENARIOS if s.client == client).sends]
        ws.send_text(json.dumps(other[0]))
        ws.send_text(json.dumps(barge_in.sends[-1]))
        for message in other[1:]:
            ws.send_text(json.dumps(message))
        replies = until_final(ws, "other")
    first, second = streams.opened
    assert first.cancelled and not first.ended and second.ended and not second.cancelled
    mine = [r for r in replies if r.get("contextId") == CONTEXT]
    # its first sentence's alignment may still come (its audio was out), then its end; no audio after
    assert mine[-1] == {"isFinal": True, "contextId": CONTEXT} and not [r for r in mine if r.get("audio")]
    assert audio_of(replies, "other")


def test_a_second_close_context_while_it_speaks_is_a_barge_in():
    streams = FakeStreams(hold_first=True)  # the stream never ends: it is still speaking
    turn = next(s for s in SCENARIOS if s.client == "pipecat").sends
    with app_for(streams).websocket_connect(url_of("pipecat")) as ws:
        for message in turn + turn[-1:]:
            ws.send_text(json.dumps(message))
        replies = until_final(ws)
    assert streams.opened[0].ended and streams.opened[0].cancelled and audio_of(replies)


def test_close_socket_speaks_every_context_to_its_end_then_closes():
    streams = FakeStreams()
    with app_for(streams).websocket_connect(PCM) as ws:
        for ctx in ("a", "b"):
            ws.send_text(json.dumps({"text": "Some words. ", "context_id": ctx}))
        ws.send_text(json.dumps({"close_socket": True}))
        replies = []
        while (reply := ws.receive())["type"] == "websocket.send":
            replies.append(json.loads(reply["text"]))
    assert reply["type"] == "websocket.close" and all(s.ended for s in streams.opened)
    assert {r["contextId"] for r in replies if r.get("isFinal")} == {"a", "b"}
    assert audio_of(replies, "a") and audio_of(replies, "b")


def test_speed_seed_and_language_reach_the_stream_and_ulaw_is_8_khz():
    streams = FakeStreams()
    url = f"{MULTI}?output_format=ulaw_8000&language_code=de"
    with app_for(streams).websocket_connect(url) as ws:
        ws.send_text(json.dumps({"text": "Hallo. ", "voice_settings": {"speed": 1.2, "stability": 0.5}, "seed": 7,
                                 "context_id": "c"}))  # fmt: skip
        ws.send_text(json.dumps({"context_id": "c", "flush": True}))
        ws.send_text(json.dumps({"context_id": "c", "close_context": True}))
        codes = audio_of(until_final(ws, "c"), "c")
    assert streams.opened[0].fields == {"language": "German", "seed": 7, "speed": 1.2, "voice_id": VOICE_ID}
    assert len(codes) == soxr.resample(tone(len("Hallo. ")), 24000, 8000, quality=QUALITY).size


def test_keep_alives_keep_a_context_from_idling_out():
    streams = FakeStreams()
    with app_for(streams, context_idle_seconds=0.3, idle_seconds=0.3).websocket_connect(PCM) as ws:
        ws.send_text(json.dumps({"text": " ", "context_id": "c"}))
        for _ in range(6):  # 0.6 s, twice the idle bound, in keep-alives: Pipecat's and the keep_alive flag
            ws.send_text(json.dumps({"text": "", "context_id": "c"}))
            ws.send_text(json.dumps({"keep_alive": True, "context_id": "c"}))
            time.sleep(0.1)
        ws.send_text(json.dumps({"text": "Still here. ", "context_id": "c", "flush": True}))
        first = ws.receive_json()
    assert first["audio"] and first["contextId"] == "c"  # not the context's idle error


def refused(url: str, messages: list, **bounds) -> list[dict]:
    """The replies to ``messages`` up to the first error, and that error."""
    with app_for(FakeStreams(hold_first=True), **bounds).websocket_connect(url) as ws:
        for m in messages:
            ws.send_bytes(m) if isinstance(m, bytes) else ws.send_text(m if isinstance(m, str) else json.dumps(m))
        replies = [ws.receive_json()]
        while "error" not in replies[-1]:
            replies.append(ws.receive_json())
    return replies


OPEN = {"text": "Waiting for more", "context_id": "c1"}


@pytest.mark.parametrize(
    ("url", "messages", "named", "status"),
    [
        (f"{MULTI}?output_format=wav_24000", [], "output_format 'wav_24000' is not made on the socket", 400),
        (f"{MULTI}?inactivity_timeout=999", [], "inactivity_timeout must be an integer in 1..180", 400),
        (f"{MULTI}?language_code=xx", [], "language_code 'xx' is not spoken here", 400),
        (PCM, ["{not json"], "a message must be a JSON object", 400),
        (PCM, [b"\x00"], "binary frames are not read", 400),
        (PCM, [{**OPEN, "voice_settings": {"speed": 9}}], "voice_settings.speed", 400),
        ("/v1/text-to-speech/nobody/multi-stream-input", [OPEN], "voice 'nobody' is not registered", 400),
        (PCM, [{**OPEN, "text": "x" * 40}], "context text too long", 413),
        (PCM, [{**OPEN, "context_id": f"c{i}"} for i in range(3)], "too many contexts: a socket has at most 2", 400),
        (PCM, [{**OPEN, "text": "a"}] * 5, "too many messages", 429),
        (f"{PCM}&inactivity_timeout=1", [OPEN], "context idle: no text for 1 s", 408),
    ],
)  # fmt: skip
def test_every_refusal_is_named_in_elevenlabs_shape(url, messages, named, status):
    replies = refused(url, messages, contexts=2, context_chars=30, message_burst=4, messages_per_second=0.01)
    error = replies[-1]
    assert named in error["error"] and error["message"] == error["error"] and error["code"] == status, error
    assert error["status"] == {400: "invalid_request", 408: "timeout", 413: "request_too_large",
                               429: "too_many_requests"}[status]  # fmt: skip


def test_sockets_beyond_the_bound_are_refused_by_name_whatever_their_vendor():
    client: TestClient = app_for(FakeStreams(), sockets=1)
    with client.websocket_connect("/tts/websocket"):
        with client.websocket_connect(PCM) as second:
            refusal = second.receive_json()
            closed = second.receive()
    assert refusal["error"].startswith("too many sockets") and refusal["code"] == 503
    assert closed == {"type": "websocket.close", "code": socket_bounds.TRY_AGAIN_LATER, "reason": ""}


def test_stream_input_error_is_its_last_reply_before_the_close():
    with app_for(FakeStreams()).websocket_connect("/v1/text-to-speech/nobody/stream-input") as ws:
        ws.send_text(json.dumps({"text": " "}))
        ws.send_text(json.dumps({"text": "Hello. "}))
        ws.send_text(json.dumps({"text": ""}))
        replies = []
        while (reply := ws.receive())["type"] == "websocket.send":
            replies.append(json.loads(reply["text"]))
    assert len(replies) == 1 and "voice 'nobody' is not registered" in replies[0]["message"]


def test_one_address_has_one_share_of_the_sockets_whatever_their_vendor():
    client: TestClient = app_for(FakeStreams(), sockets_per_peer=1)
    with client.websocket_connect(PCM):
        with client.websocket_connect("/tts/websocket") as second:
            refusal = second.receive_json()
    assert refusal["error"].startswith("too many sockets from your address: at most 1")


def test_a_peer_that_does_not_read_is_cut_at_the_unsent_audio_bound(caplog):
    """The core's one writer and bound, under ElevenLabs' dialect (gateway/outbox.py)."""
    peer, streams = (
        StuckPeer([{"text": "Hello there. ", "context_id": "c", "flush": True}]),
        FakeStreams(hold_first=True),
    )
    dialect = ElevenLabsSocket(read_query("default", {"output_format": "pcm_24000"}), multi=True)

    async def run():
        socket = TextSocket(peer, dialect, streams, Voices().get, socket_bounds.SocketBounds(), 0.05, PEER)
        await asyncio.wait_for(socket.run(), 10)

    with caplog.at_level(logging.WARNING, logger="gateway"):
        asyncio.run(run())
    assert peer.aborted and streams.opened[0].cancelled
    assert [r.getMessage() for r in caplog.records] == [
        f"an agent socket from {PEER} cut: not reading: its client left 0.1 s of audio untaken (the bound: 0.05 s)"]  # fmt: skip
