"""The Cartesia agent WebSocket (gateway/dialects/cartesia_socket.py on gateway/text_socket.py) without a server: a fake text stream under the route, the
plugins' message sequences (tests/fixtures/cartesia_plugins.py: livekit-plugins-cartesia 1.8.9, pipecat-ai
1.14.0) replayed through Starlette's test client, and every refusal by its name."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import soxr
from fastapi import FastAPI
from starlette.testclient import TestClient

from client.request import ServerBusy
from client.text_in import Flushed
from client.tts_client import Chunk
from gateway import cartesia, socket_bounds
from gateway.app import add_agent_routes
from gateway.rates import QUALITY
from serving.config.options import ServeOptions
from tests.fixtures.cartesia_plugins import CONTEXT, SCENARIOS, VOICE_ID
from tests.unit.test_g711 import mulaw_decode

_END = object()


def tone(n_chars: int) -> np.ndarray:
    """The fake's audio for a unit: 100 samples a character of a 440 Hz tone at 24 kHz."""
    t = np.arange(100 * n_chars) / 24000
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


class FakeStream:
    """The text-stream API (gateway.text_streams) in process: a unit's audio comes at its flush or the end."""

    def __init__(self, fields: dict, fail: Exception | None = None, hold: bool = False):
        self.fields, self.fail, self.hold = fields, fail, hold  # hold: the end never comes (still speaking)
        self.sent, self.ended, self.cancelled = [], False, False
        self.unit, self.flushes, self.out = "", 0, asyncio.Queue()

    async def send(self, text: str, flush: bool = False) -> None:
        self.sent.append((text, flush))
        self.unit += text
        if flush:
            self.flushes += 1
            self._speak()
            self.out.put_nowait(Flushed(self.flushes))

    def _speak(self) -> None:
        if self.unit.strip():
            self.out.put_nowait(self.fail or Chunk(tone(len(self.unit)), 0.0))
        self.unit = ""

    async def end(self) -> None:
        self.ended = True
        self._speak()
        if not self.hold:
            self.out.put_nowait(_END)

    async def cancel(self) -> None:
        self.cancelled = True
        self.out.put_nowait(_END)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            item = await self.out.get()
        except asyncio.CancelledError:
            if self.cancelled:  # as client.text_in's stream does: a cancelled stream's iteration just ends
                raise StopAsyncIteration from None
            raise
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item


class FakeStreams:
    def __init__(self, fail: Exception | None = None, hold_first: bool = False):
        self.opened: list[FakeStream] = []
        self.fail, self.hold_first = fail, hold_first

    async def __call__(self, pace=None, **fields) -> FakeStream:
        self.opened.append(FakeStream(fields, self.fail, self.hold_first and not self.opened))
        self.opened[-1].pace = pace  # every context's stream is paced (gateway.outbox)
        return self.opened[-1]


class Voices:
    async def get(self) -> list[dict]:
        return [{"name": VOICE_ID}, {"name": "anna"}]


def app_for(streams: FakeStreams, **bounds) -> TestClient:
    app = FastAPI()
    add_agent_routes(app, streams, Voices(), socket_bounds.SocketBounds(**bounds))
    return TestClient(app)


def until_done(ws, context_id: str = CONTEXT) -> list[dict]:
    replies = []
    while True:
        replies.append(ws.receive_json())
        if replies[-1]["type"] == "done" and replies[-1]["context_id"] == context_id:
            return replies


def audio_of(replies: list[dict]) -> bytes:
    return b"".join(base64.b64decode(r["data"]) for r in replies if r["type"] == "chunk")


ENDING = [s for s in SCENARIOS if s.sends[-1].get("continue") is False and len({m["context_id"] for m in s.sends}) == 1]


@pytest.mark.parametrize("scenario", ENDING, ids=lambda s: f"{s.plugin}: {s.what[:40]}")
def test_a_plugins_reply_comes_back_as_its_sentences_audio_words_and_one_done(scenario):
    streams = FakeStreams()
    with app_for(streams).websocket_connect("/tts/websocket?cartesia_version=2025-04-16") as ws:
        for message in scenario.sends:
            ws.send_text(json.dumps(message))
        replies = until_done(ws)
    assert all(r["context_id"] == CONTEXT for r in replies) and [r["type"] for r in replies].count("done") == 1
    assert all(r["data"] for r in replies if r["type"] == "chunk")
    stream = streams.opened[0]
    texts = [m["transcript"] for m in scenario.sends]
    last = [(texts[-1], False)] if texts[-1] else []  # LiveKit's end is " ", Pipecat's ""
    assert stream.sent == [(t, True) for t in texts[:-1]] + last and stream.ended  # a message a segment
    assert stream.fields["language"] == "English" and stream.fields["voice_id"] == VOICE_ID
    rate = scenario.sends[0]["output_format"]["sample_rate"]
    whole = np.concatenate([tone(len(t)) for t in texts if t.strip()])
    expected = np.round(np.clip(soxr.resample(whole, 24000, rate, quality=QUALITY), -1, 1) * 32767)
    got = np.frombuffer(audio_of(replies), "<i2")
    assert got.size == expected.size and np.max(np.abs(got - expected)) <= 1
    words = [w for r in replies if r["type"] == "timestamps" for w in r["word_timestamps"]["words"]]
    assert words == " ".join(texts).split()
    ends = [t for r in replies if r["type"] == "timestamps" for t in r["word_timestamps"]["end"]]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(whole.size / 24000, abs=1e-3)


def test_pipecats_cancel_stops_the_context_and_nothing_more_comes_for_it():
    streams = FakeStreams()
    cancel = next(s for s in SCENARIOS if s.plugin == "pipecat" and "cancel" in s.sends[-1])
    with app_for(streams).websocket_connect("/tts/websocket") as ws:
        for message in cancel.sends:
            ws.send_text(json.dumps(message))
        other = {**cancel.sends[0], "context_id": "other", "continue": False}
        ws.send_text(json.dumps(other))
        replies = until_done(ws, "other")
    assert streams.opened[0].cancelled and not streams.opened[1].cancelled
    assert not [r for r in replies if r["context_id"] == CONTEXT and r["type"] in ("done", "error")]


def test_livekits_barge_in_closes_the_socket_and_that_cancels_its_contexts():
    streams = FakeStreams()
    barge_in = next(s for s in SCENARIOS if s.plugin == "livekit" and "barge-in" in s.what)
    with app_for(streams).websocket_connect("/tts/websocket") as ws:
        for message in barge_in.sends:
            ws.send_text(json.dumps(message))
        ws.receive_json()  # its first audio: the context is open
    assert streams.opened[0].cancelled and not streams.opened[0].ended


GOOD = {"context_id": "c1", "transcript": "Hello there. ", "continue": False, "voice": {"mode": "id", "id": "default"},
        "output_format": {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}}  # fmt: skip


def test_mulaw_at_8_khz_decodes_back_within_the_codecs_error():
    with app_for(FakeStreams()).websocket_connect("/tts/websocket") as ws:
        ws.send_text(json.dumps(GOOD))
        codes = np.frombuffer(audio_of(until_done(ws, "c1")), np.uint8)
    resampled = soxr.resample(tone(len(GOOD["transcript"])), 24000, 8000, quality=QUALITY)
    decoded = mulaw_decode(codes) / 32767
    assert decoded.size == resampled.size
    assert np.sqrt(np.mean((decoded - resampled) ** 2)) < 0.02 * np.sqrt(np.mean(resampled**2))


def test_f32_volume_speed_and_our_extensions_reach_the_stream():
    streams = FakeStreams()
    message = {**GOOD, "output_format": {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 24000},
               "generation_config": {"speed": 1.5, "volume": 2.0}, "seed": 7, "parameters": {"max_patches": 8},
               "voice": {"mode": "id", "id": "alloy"}, "instructions": "A calm, low voice."}  # fmt: skip
    with app_for(streams).websocket_connect("/tts/websocket") as ws:
        ws.send_text(json.dumps(message))
        got = np.frombuffer(audio_of(until_done(ws, "c1")), "<f4")
    fields = streams.opened[0].fields
    assert fields == {"language": None, "seed": 7, "speed": 1.5, "parameters": {"max_patches": 8},
                      "instruction": "A calm, low voice."}  # fmt: skip
    assert np.array_equal(got, np.clip(2 * tone(len(GOOD["transcript"])), -1, 1))


PCM24 = {**GOOD, "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
         "add_timestamps": True}  # fmt: skip


def test_a_client_flush_is_answered_with_flush_done_after_its_audio():
    with app_for(FakeStreams()).websocket_connect("/tts/websocket") as ws:
        ws.send_text(json.dumps({**PCM24, "continue": True, "max_buffer_delay_ms": 3000, "transcript": "Half a"}))
        ws.send_text(json.dumps({**PCM24, "continue": True, "transcript": "", "flush": True}))
        first = [ws.receive_json() for _ in range(3)]
        ws.send_text(json.dumps({**PCM24, "transcript": ""}))
        rest = until_done(ws, "c1")
    assert [r["type"] for r in first] == ["chunk", "timestamps", "flush_done"] and first[2]["flush_id"] == 1
    assert first[1]["word_timestamps"]["words"] == ["Half", "a"] and [r["type"] for r in rest] == ["done"]


def test_unflushed_text_is_flushed_when_its_buffer_delay_runs_out():
    streams = FakeStreams()
    with app_for(streams).websocket_connect("/tts/websocket") as ws:
        ws.send_text(json.dumps({**PCM24, "continue": True, "max_buffer_delay_ms": 50, "transcript": "Some words"}))
        assert ws.receive_json()["type"] == "chunk"  # no flush sent: the delay's
        ws.send_text(json.dumps({**PCM24, "transcript": ""}))
        until_done(ws, "c1")
    assert streams.opened[0].sent == [("Some words", False), ("", True)]


def refusals(messages: list, streams: FakeStreams | None = None, **bounds) -> list[dict]:
    """The replies to ``messages`` (text, or bytes for a binary frame), up to the last error or done."""
    with app_for(streams or FakeStreams(), **bounds).websocket_connect("/tts/websocket") as ws:
        for m in messages:
            ws.send_bytes(m) if isinstance(m, bytes) else ws.send_text(m if isinstance(m, str) else json.dumps(m))
        ws.send_text(json.dumps({**GOOD, "context_id": "last"}))
        replies = until_done(ws, "last")
    return [r for r in replies if r["context_id"] != "last"]


@pytest.mark.parametrize(
    ("messages", "named", "context"),
    [
        (["not json"], "a message must be a JSON object", ""),
        (["x" * 70_000], "a message is at most", ""),
        ([b"\x00\x01"], "binary frames are not read", ""),
        ([{**GOOD, "voice": {"mode": "id", "id": "nobody"}}], "voice 'nobody' is not registered", "c1"),
        ([{**GOOD, "voice": {"mode": "id", "id": "anna"}, "instructions": "A deep voice."}], "instructions design", "c1"),
        ([{**GOOD, "output_format": {**GOOD["output_format"], "sample_rate": 11025}}], "sample_rate", "c1"),
        ([{**GOOD, "generation_config": {"emotion": ["positivity"]}}], "emotion is not supported", "c1"),
        ([{**GOOD, "generation_config": {"speed": 9}}], "speed", "c1"),
        ([{**GOOD, "parameters": {"nope": 1}}], "parameters.nope is unknown", "c1"),
        ([{**GOOD, "continue": True}, {**GOOD, "transcript": "x" * 40}], "context text too long", "c1"),
        ([{**GOOD, "continue": True, "context_id": f"c{i}"} for i in range(3)], "too many contexts", "c2"),
        ([{**GOOD, "continue": True, "transcript": "a"} for _ in range(5)], "too many messages", "c1"),
    ],
)  # fmt: skip
def test_every_refusal_is_named_with_its_context_then_done_and_nothing_stays_open(messages, named, context):
    streams = FakeStreams()
    replies = refusals(messages, streams, contexts=2, context_chars=30, message_burst=4, messages_per_second=0.01)
    errors = [r for r in replies if r["type"] == "error"]
    assert len(errors) == 1 and named in errors[0]["error"] and errors[0]["context_id"] == context, replies
    if context:
        assert replies[replies.index(errors[0]) + 1] == cartesia.done(context)
    assert all(s.cancelled or s.ended for s in streams.opened)


def test_a_failing_stream_is_an_error_then_done():
    replies = refusals([GOOD], FakeStreams(fail=ServerBusy("every slot is busy")))
    assert [(r["type"], r.get("status_code")) for r in replies] == [("error", 503), ("done", 200)]
    assert "every slot is busy" in replies[0]["error"]


def test_text_after_the_end_is_refused_by_name():
    streams = FakeStreams(hold_first=True)
    replies = refusals([{**GOOD, "continue": True, "transcript": "A"}, {**GOOD, "transcript": ""},
                        {**GOOD, "transcript": "more"}], streams)  # fmt: skip
    assert [r["error"] for r in replies if r["type"] == "error"] == [socket_bounds.ENDED]
    assert len(streams.opened) == 2 and streams.opened[0].cancelled  # the socket's close ended it


def test_a_cancelled_or_failed_contexts_late_messages_are_dropped_not_spoken():
    streams = FakeStreams(hold_first=True)
    late = {**PCM24, "continue": True, "max_buffer_delay_ms": 0, "transcript": "rest of the sentence"}
    replies = refusals([{**late, "context_id": "a"}, {"context_id": "a", "cancel": True}, {**late, "context_id": "a"},
                        {**late, "context_id": "b", "transcript": "x" * 40}, {**late, "context_id": "b"}],
                       streams, context_chars=30)  # fmt: skip
    assert len(streams.opened) == 3  # a, b and "last": nothing opened for a's or b's late text
    assert [(r["type"], r["context_id"]) for r in replies if r["type"] in ("error", "done")] == [
        ("error", "b"), ("done", "b")]  # fmt: skip


def test_idle_sockets_and_contexts_are_ended_by_name():
    streams = FakeStreams()
    with app_for(streams, idle_seconds=0.2, context_idle_seconds=0.2).websocket_connect("/tts/websocket") as ws:
        ws.send_text(json.dumps({**PCM24, "continue": True, "max_buffer_delay_ms": 0}))
        replies = [ws.receive_json() for _ in range(5)]  # chunk, timestamps, error, done, the socket's error
        closed = ws.receive()
    assert [r["type"] for r in replies] == ["chunk", "timestamps", "error", "done", "error"]
    assert replies[2]["error"].startswith("context idle") and replies[4]["error"].startswith("socket idle")
    assert closed["type"] == "websocket.close" and streams.opened[0].cancelled


def test_by_default_a_context_waiting_for_text_ends_by_the_sockets_bound_before_the_servers():
    """The default context idle bound is 5 s under the server's default --text-idle-seconds, so that the client
    gets its name and 408, not the server's 400 (the 408 against a real server: test_agent_socket_server's
    idle test, with a 1 s bound; the gateway forwards text at once or later, so the server's clock of a
    context's silence never starts sooner than the socket's)."""
    idle = socket_bounds.SocketBounds().context_idle_seconds
    assert idle == ServeOptions().text_idle_seconds - 5 == 25
    assert socket_bounds.CONTEXT_IDLE.format(s=idle).startswith("context idle: no text for 25 s")


def test_sockets_beyond_the_bound_are_refused_by_name():
    client = app_for(FakeStreams(), sockets=1)
    with client.websocket_connect("/tts/websocket") as first:
        with client.websocket_connect("/tts/websocket") as second:
            refused = second.receive_json()
            closed = second.receive()
            assert closed == {"type": "websocket.close", "code": socket_bounds.TRY_AGAIN_LATER, "reason": ""}
        first.send_text(json.dumps(GOOD))
        assert until_done(first, "c1")[0]["type"] == "chunk"
    assert refused["error"].startswith("too many sockets")
