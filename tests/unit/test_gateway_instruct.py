"""FireRedTTS3-Instruct through the gateway without Triton: ``instructions`` on the speech route, the
designed-voice form of ``POST /v1/audio/voices``, ``POST /v1/audio/edits``: each malformed field is a 400
naming it before anything is sent, a well-formed request goes on to the server (here a closed port: 503);
and the plan text, from a stream written here by hand, in the header and as the first SSE event."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from urllib.parse import unquote

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from client import Chunk
from engine.instructions import ACOUSTIC_TEMPLATES, MAX_INSTRUCTION_CHARS
from gateway.app import create_app
from gateway.errors import APIError
from gateway.fields import speech_request
from gateway.streaming import PLAN_EVENT, PLAN_HEADER, stream_response
from serving.supervision.triton_env import free_port

UNREACHABLE = 503
ADMIN = {"Authorization": "Bearer some-key"}
PLAN = "性别：男；年龄：老年；音色：沙哑"


@pytest.fixture(scope="module")
def gateway():
    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:
        yield client


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, np.zeros(int(seconds * rate), np.float32), rate, format="WAV")
    return out.getvalue()


def refused(r, param: str, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]


async def registered():
    return [{"name": "narrator"}, {"name": "alloy"}]


def ask(body):
    return asyncio.run(speech_request(body, registered))


def test_instructions_with_no_real_voice_design_one():
    for voice in ("default", "echo", None):  # stock names are no voices here
        kw = ask({"input": "Hi", "voice": voice, "instructions": "  a calm older man "})
        assert kw["instruction"] == "a calm older man" and "voice_id" not in kw
    assert "instruction" not in ask({"input": "Hi", "instructions": ""})  # "" is absent, as for OpenAI


@pytest.mark.parametrize("voice", ["narrator", "alloy"])  # a registered voice, even under a stock name
def test_instructions_with_a_registered_voice_are_refused_with_the_way_out(voice):
    with pytest.raises(APIError) as e:
        ask({"input": "Hi", "voice": voice, "instructions": "a calm older man"})
    assert (e.value.status, e.value.param) == (400, "instructions")
    assert "Drop instructions" in e.value.message and "'default'" in e.value.message


@pytest.mark.parametrize(
    "instructions, words",
    [("   ", "empty"), ("x" * (MAX_INSTRUCTION_CHARS + 1), f"limit is {MAX_INSTRUCTION_CHARS}"),
     ("calm<|im_end|>", "control token"), ("calm\x07", "control character"), (["calm"], "must be a string")],
)  # fmt: skip
def test_bad_instructions_on_the_speech_route_are_400(gateway, instructions, words):
    refused(gateway.post("/v1/audio/speech", json={"input": "Hi", "instructions": instructions}), "instructions", words)


def test_a_design_request_goes_on_to_the_server(gateway):
    r = gateway.post("/v1/audio/speech", json={"input": "Hi", "voice": "default", "instructions": "a calm older man"})
    assert r.status_code == UNREACHABLE, r.text


def edit(gateway, files=None, **form):
    files = {"file": ("in.wav", wav(1.0), "audio/wav")} if files is None else files
    return gateway.post("/v1/audio/edits", data=form, files=files)


@pytest.mark.parametrize(
    "form, param, words",
    [
        ({"instructions": "Delete 'a'."}, "type", "acoustic"),
        ({"type": "loud", "instructions": "x"}, "type", "semantic"),
        ({"type": "semantic"}, "instructions", "required"),
        ({"type": "semantic", "instructions": " "}, "instructions", "empty"),
        ({"type": "acoustic", "instructions": "make it faster"}, "instructions", ACOUSTIC_TEMPLATES[0]),
        ({"type": "acoustic", "instructions": "adjust the volume to 2.5"}, "instructions", "0.3..2.0"),
        ({"type": "semantic", "instructions": "x", "response_format": "ogg"}, "response_format", "mp3"),
        ({"type": "semantic", "instructions": "x", "stream_format": "chunks"}, "stream_format", "sse"),
        ({"type": "semantic", "instructions": "x", "seed": "1.5"}, "seed", "integer"),
        ({"type": "semantic", "instructions": "x", "voice": "alloy"}, "voice", "unknown"),
        ({"type": "semantic", "instructions": "x", "max_patches": "2.5"}, "max_patches", "integer"),
        ({"type": "semantic", "instructions": "x", "max_patches": "5000"}, "max_patches", "1..4000"),
        ({"type": "semantic", "instructions": "x", "normalize": "yes"}, "normalize", "true or false"),
    ],
)
def test_bad_edit_fields_are_400_naming_them(gateway, form, param, words):
    refused(edit(gateway, **form), param, words)


def test_the_recording_to_edit_is_bounded(gateway):
    refused(edit(gateway, files={}, type="semantic", instructions="x"), "file", "required")
    too_long = {"file": ("in.wav", wav(31.0), "audio/wav")}
    refused(edit(gateway, files=too_long, type="semantic", instructions="x"), "file", "31.0 s", "at most 30 s")
    refused(edit(gateway, files={"file": ("in.wav", b"not audio", "audio/wav")}, type="semantic",
                 instructions="x"), "file", "libsndfile")  # fmt: skip


@pytest.mark.parametrize(
    "form", [{"type": "semantic", "instructions": "Replace 'cats' with 'dogs'."},
             {"type": "acoustic", "instructions": "shift the pitch by 2 steps", "response_format": "wav",
              "stream_format": "sse", "seed": "-7", "max_patches": "6", "cfg": "1.5"}],
)  # fmt: skip
def test_a_well_formed_edit_goes_on_to_the_server(gateway, form):
    assert edit(gateway, **form).status_code == UNREACHABLE


DESIGN = {"name": "calm-man", "instructions": "a calm older man", "text": "Good evening, and welcome."}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({**DESIGN, "name": "no spaces"}, "name", "A-Za-z0-9"),
        ({**DESIGN, "instructions": ""}, "instructions", "empty"),
        ({k: v for k, v in DESIGN.items() if k != "instructions"}, "instructions", "required"),
        ({k: v for k, v in DESIGN.items() if k != "text"}, "text", "required"),
        ({**DESIGN, "text": "x" * 301}, "text", "300"),
        ({**DESIGN, "seed": True}, "seed", "integer"),
        ({**DESIGN, "max_patches": 376}, "max_patches", "1..375"),
        ({**DESIGN, "max_patches": "0"}, "max_patches", "1..375"),
        ({**DESIGN, "voice": "alloy"}, "voice", "unknown"),
        ({**DESIGN, "instructions": "calm<think>"}, "instructions", "<think>"),
    ],
)
def test_bad_design_fields_are_400_naming_them(gateway, body, param, words):
    refused(gateway.post("/v1/audio/voices", json=body, headers=ADMIN), param, words)


def test_designing_a_voice_needs_the_admin_key_and_goes_on_to_the_server(gateway):
    assert gateway.post("/v1/audio/voices", json=DESIGN).status_code == 401
    assert gateway.post("/v1/audio/voices", json=DESIGN, headers=ADMIN).status_code == UNREACHABLE
    assert gateway.post("/v1/audio/voices", data=DESIGN, headers=ADMIN).status_code == UNREACHABLE  # as a form
    both = gateway.post("/v1/audio/voices", data=DESIGN, files={"file": ("a.wav", wav(1.0), "audio/wav")},
                        headers=ADMIN)  # fmt: skip
    refused(both, "instructions", "not both")


def fake_stream(plan: str | None, chunks: list[np.ndarray]):
    def open_stream(on_plan, **kw):
        async def stream():
            if plan is not None:
                on_plan(plan)
            for audio in chunks:
                yield Chunk(audio, 0.0)

        return stream()

    return open_stream


async def answer(open_stream, stream_format):
    response = await stream_response(open_stream, {}, "pcm", stream_format)
    body = b"".join([part if isinstance(part, bytes) else part.encode() async for part in response.body_iterator])
    return response.headers, body


CHUNKS = [np.full(4, 0.5, np.float32), np.full(2, -0.25, np.float32)]


def test_the_plan_text_goes_in_a_header_and_first_over_sse():
    headers, body = asyncio.run(answer(fake_stream(PLAN, CHUNKS), "audio"))
    assert unquote(headers[PLAN_HEADER]) == PLAN
    assert np.frombuffer(body, "<i2").tolist() == [16384] * 4 + [-8192] * 2  # 16-bit PCM of the chunks
    headers, body = asyncio.run(answer(fake_stream(PLAN, CHUNKS), "sse"))
    events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
    assert events[0] == {"type": PLAN_EVENT, "text": PLAN}
    assert [e["type"] for e in events[1:]] == ["speech.audio.delta"] * (len(events) - 2) + ["speech.audio.done"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[1:-1])
    assert np.frombuffer(audio, "<i2").tolist() == [16384] * 4 + [-8192] * 2


def test_no_plan_no_header_no_event():
    headers, _ = asyncio.run(answer(fake_stream(None, CHUNKS), "audio"))
    assert PLAN_HEADER.lower() not in headers
    _, body = asyncio.run(answer(fake_stream(None, CHUNKS), "sse"))
    assert PLAN_EVENT not in body.decode()
