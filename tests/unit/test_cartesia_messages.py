"""Cartesia's WebSocket messages (gateway/cartesia.py) against what the agent plugins send and read
(tests/fixtures/cartesia_plugins.py, read from livekit-plugins-cartesia 1.8.9 and pipecat-ai 1.14.0)."""

from __future__ import annotations

import base64
import json

import pytest

from gateway import cartesia
from gateway.cartesia import Cancel, Generate, ProtocolError, parse_message
from tests.fixtures.cartesia_plugins import CONTEXT, REPLIES, SCENARIOS, VOICE_ID


def livekit_reads(reply: dict, context_id: str = CONTEXT) -> str:
    """What LiveKit's receive loop makes of a reply, in its order of tests (READS["livekit"])."""
    if reply.get("context_id") is not None and reply["context_id"] != context_id:
        return "skipped"
    if reply.get("data"):
        return "audio"
    if reply.get("done"):
        return "done"
    if reply.get("word_timestamps"):
        return "timestamps"
    if reply.get("type") == "error":
        return "error"
    return "ignored" if reply.get("type") == "flush_done" else "warning"


def pipecat_reads(reply: dict, open_contexts=(CONTEXT,)) -> str:
    """What Pipecat's _process_messages makes of a reply (READS["pipecat"]): KeyError without context_id."""
    if reply["context_id"] not in open_contexts:
        return "skipped"
    kinds = {"chunk": "audio", "done": "done", "timestamps": "timestamps", "error": "error", "flush_done": "ignored"}
    return kinds.get(reply["type"], "unknown type")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s.plugin}: {s.what[:40]}")
def test_every_message_the_plugins_send_parses(scenario):
    for message in scenario.sends:
        request = parse_message(json.dumps(message))
        assert request.context_id == message["context_id"]
        if "cancel" in message:
            assert isinstance(request, Cancel)
            continue
        assert isinstance(request, Generate)
        assert (request.transcript, request.more) == (message["transcript"], message["continue"])
        assert request.voice_id == VOICE_ID and request.language == "English"
        assert request.encoding == "pcm_s16le" and request.sample_rate == message["output_format"]["sample_rate"]
        assert request.timestamps and request.buffer_delay_ms == 0 and not request.flush


def test_the_end_of_a_context_as_each_plugin_sends_it():
    requests = [parse_message(json.dumps(m)) for s in SCENARIOS for m in s.sends if "cancel" not in m]
    assert {(r.transcript, r.more) for r in requests if not r.more} == {(" ", False), ("", False)}


def test_replies_read_by_both_plugins_as_meant():
    audio = b"\x01\x02" * 240
    replies = {
        "audio": cartesia.chunk(CONTEXT, audio, 41.5),
        "timestamps": cartesia.timestamps(CONTEXT, ["Hello", "there,"], [0.0, 0.42], [0.38, 0.9]),
        "ignored": cartesia.flush_done(CONTEXT, 1),
        "done": cartesia.done(CONTEXT),
        "error": cartesia.error(CONTEXT, 400, "voice 'x' is not registered"),
    }
    for meant, reply in replies.items():
        assert livekit_reads(json.loads(json.dumps(reply))) == meant
        assert pipecat_reads(reply) == meant
        assert set(reply) == set(REPLIES[reply["type"]])  # Cartesia's shapes, as the fixtures record them
    assert base64.b64decode(replies["audio"]["data"]) == audio


def test_cartesias_own_error_shape_is_a_normal_end_to_livekit():
    """Why our error has no done: LiveKit tests done before type."""
    assert livekit_reads({**REPLIES["error"], "done": True}) == "done"
    assert livekit_reads(cartesia.error(CONTEXT, 500, "failed")) == "error"


def test_a_message_without_a_readable_context_gets_an_error_both_plugins_survive():
    reply = cartesia.error(None, 400, "a message must be a JSON object")
    assert pipecat_reads(reply) == "skipped" and livekit_reads(reply) == "skipped"


def test_no_empty_audio_and_one_time_a_word():
    with pytest.raises(ValueError):
        cartesia.chunk(CONTEXT, b"", 1.0)
    with pytest.raises(ValueError):
        cartesia.timestamps(CONTEXT, ["a", "b"], [0.0], [0.1])


def out(container, encoding, sample_rate) -> dict:
    return {"container": container, "encoding": encoding, "sample_rate": sample_rate}


GOOD = {"context_id": "c1", "transcript": "Hi. ", "continue": True, "voice": {"mode": "id", "id": "default"},
        "output_format": {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"context_id": 5}, "context_id"),
        ({"context_id": "x" * 300}, "context_id"),
        ({"transcript": 5}, "transcript"),
        ({"continue": "yes"}, "continue"),
        ({"voice": {"mode": "embedding", "embedding": [0.1]}}, "voice"),
        ({"voice": 5}, "voice"),
        ({"voice": {"mode": "id", "id": 5}}, "voice"),
        ({"output_format": out("wav", "pcm_s16le", 8000)}, "output_format.container"),
        ({"output_format": out("raw", "mp3", 8000)}, "output_format.encoding"),
        ({"output_format": out("raw", "pcm_alaw", 11025)}, "output_format.sample_rate"),
        ({"output_format": out("raw", "pcm_alaw", True)}, "output_format.sample_rate"),
        ({"output_format": None}, "output_format"),
        ({"max_buffer_delay_ms": 6000}, "max_buffer_delay_ms"),
        ({"add_timestamps": 1}, "add_timestamps"),
        ({"language": "tlh"}, "language"),
        ({"language": ["en"]}, "language"),
        ({"transcript": "Hi \ud800"}, "transcript"),
        ({"voice": {"mode": "id", "id": "\udfffx"}}, "voice.id"),
        ({"context_id": "c\ud800"}, "context_id"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named_with_its_context(change, field):
    with pytest.raises(ProtocolError) as raised:
        parse_message(json.dumps({**GOOD, **change}))
    assert raised.value.field == field and field.split(".")[-1] in str(raised.value)
    assert raised.value.context_id == (None if field == "context_id" else "c1")


def test_a_lone_surrogate_is_refused_where_it_is():
    # json.dumps writes it as the escape "\\ud800", which is what a client can send; it has no UTF-8
    message = json.dumps({**GOOD, "transcript": "Say \ud800 no more", "continue": False})
    with pytest.raises(ProtocolError) as raised:
        parse_message(message)
    assert str(raised.value) == "transcript must be valid Unicode text: it contains a lone surrogate at character 4"
    assert (raised.value.field, raised.value.context_id) == ("transcript", "c1")


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"transcript": "no context"}', "[" * 60_000, "x" * 70_000])
def test_what_is_no_message(text):
    with pytest.raises(ProtocolError) as raised:
        parse_message(text)
    assert raised.value.context_id is None


@pytest.mark.parametrize(
    ("code", "name"),
    [("en", "English"), ("en-US", "English"), ("zh", "Chinese"), ("pt-BR", "Portuguese"), ("French", "French"),
     ("auto", None), (None, None)],
)  # fmt: skip
def test_languages_by_code_or_name(code, name):
    assert parse_message(json.dumps({**GOOD, "language": code})).language == name


@pytest.mark.parametrize("voice", ["default", {"id": "default"}, {"mode": "id", "id": "default"}])
def test_voice_as_the_sdks_plain_id_string_or_an_object(voice):
    """The Cartesia SDK (4.2.0) types voice as ``str | {"id": ...}``; its v2 contexts send the string."""
    assert parse_message(json.dumps({**GOOD, "voice": voice})).voice_id == "default"


def test_an_error_carries_what_the_sdk_prints():
    """The SDK (4.2.0) shows a socket error as f"{title}: {message}"."""
    reply = cartesia.error("c1", 503, "server busy")
    assert f"{reply['title']}: {reply['message']}" == "Service unavailable: server busy"
    assert reply["error"] == "server busy" and reply["error_code"] == "unavailable" and "done" not in reply
