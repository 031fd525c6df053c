"""Cartesia's and ElevenLabs' HTTP TTS (gateway/dialects/) through a real gateway and server: the requests the
clients send (tests/fixtures/vendor_http.py, versions named there) are answered as each client reads them; the
audio is what the same request on /v1/audio/speech gives; timings are monotonic and cover the audio; every
refusal is named in the vendor's error shape.

The one change to the clients' requests: the default voice, and our ``seed`` and ``parameters`` extensions,
which keep the utterance short and the same on every route (the test checkpoint never stops by itself).
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from tests.fixtures.vendor_http import CALLS, GETS, TEXT, VOICE

pytestmark = pytest.mark.integration
SAY = "Hello there. How are you?"
SHORT = {"max_patches": 6, "chunk_first": 1, "chunk_next": 2, "chunk_fixed": True}
OURS = {"seed": 7, "parameters": SHORT}


def ours(value):
    """A recorded request with our voice and text."""
    if isinstance(value, dict):
        return {k: ours(v) for k, v in value.items()}
    return {VOICE: "default", TEXT: SAY}.get(value, value) if isinstance(value, str) else value


def send(gateway, name: str, **changes) -> httpx.Response:
    call = CALLS[name]
    body = {**ours(call.body), **OURS, **changes}
    return httpx.request(call.method, gateway + ours(call.path).replace(VOICE, "default"), params=call.query,
                         headers=ours(call.headers), json=body, timeout=60)  # fmt: skip


def speech(gateway, **body) -> bytes:
    r = httpx.post(f"{gateway}/v1/audio/speech", json={"input": SAY, "seed": 7, **SHORT, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


@pytest.mark.parametrize("name", ["livekit-cartesia", "pipecat-cartesia"])
def test_the_agent_plugins_bytes_request_gets_the_speech_routes_pcm(gateway, name):
    r = send(gateway, name)
    assert r.status_code == 200, r.text
    rate = CALLS[name].body["output_format"]["sample_rate"]
    expected = speech(gateway, response_format="pcm", sample_rate=rate, language="English")  # their "en"
    assert np.array_equal(pcm(r.content), pcm(expected))


def test_the_sdks_generate_with_a_plain_voice_string_gets_a_wav(gateway):
    r = send(gateway, "sdk-generate")
    assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text
    assert r.content == speech(gateway, response_format="wav", sample_rate=44100)


def test_the_sdks_sse_carries_the_audio_then_word_times_then_done(gateway):
    r = send(gateway, "sdk-sse")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    got = events(r.text)
    assert [e["type"] for e in got[-2:]] == ["timestamps", "done"] and {e["type"] for e in got[:-2]} == {"chunk"}
    assert all(e["context_id"] == "<context id>" for e in got)
    floats = np.frombuffer(b"".join(base64.b64decode(e["data"]) for e in got[:-2]), "<f4")
    s16 = pcm(speech(gateway, response_format="pcm", sample_rate=44100))
    assert floats.size == s16.size and np.abs(np.round(floats * 32767) - s16).max() <= 1  # one 16-bit step
    words = got[-2]["word_timestamps"]
    assert words["words"] == SAY.split()
    assert np.all(np.diff(words["start"]) > 0) and words["start"][0] == 0 and words["end"][:-1] == words["start"][1:]
    assert words["end"][-1] == pytest.approx(floats.size / 44100, abs=2e-3)


@pytest.mark.parametrize(("container", "encoding"), [("raw", "pcm_mulaw"), ("raw", "pcm_alaw"), ("wav", "pcm_mulaw")])
def test_g711_over_cartesia_bytes_is_the_speech_routes_length(gateway, container, encoding):
    out = {"container": container, "encoding": encoding, "sample_rate": 8000}
    r = send(gateway, "pipecat-cartesia", output_format=out)
    assert r.status_code == 200, r.text
    header = 46 if container == "wav" else 0  # WAV's fmt chunk for G.711 has cbSize
    assert r.content[:4] == (b"RIFF" if header else r.content[:4])
    assert len(r.content) - header == len(speech(gateway, response_format=encoding, language="English"))


def test_generation_config_speed_and_volume_as_on_the_socket(gateway):
    config = {"speed": 2.0, "volume": 2.0}
    r = send(gateway, "livekit-cartesia", generation_config=config)
    plain = pcm(speech(gateway, response_format="pcm", speed=2.0, language="English"))
    louder = pcm(r.content)
    assert louder.size == plain.size
    assert np.abs(louder - np.clip(2 * plain, -32767, 32767)).max() <= 2  # the gain before quantizing


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"voice": "nobody-registered"}, "voice"),
        ({"voice": {"mode": "embedding", "embedding": [0.1]}}, "voice"),
        ({"transcript": " "}, "transcript"),
        ({"output_format": {"container": "ogg", "encoding": "pcm_s16le", "sample_rate": 8000}}, "output_format.container"),
        ({"output_format": {"container": "raw", "encoding": "pcm_s24le", "sample_rate": 8000}}, "output_format.encoding"),
        ({"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 11025}}, "output_format.sample_rate"),
        ({"generation_config": {"emotion": "happy"}}, "generation_config.emotion"),
        ({"generation_config": {"speed": 9}}, "generation_config.speed"),
        ({"generation_config": {"volume": 3}}, "generation_config.volume"),
        ({"language": "tlh"}, "language"),
        ({"parameters": {"steps": 0}}, "parameters.steps"),
    ],
)  # fmt: skip
def test_cartesia_refusals_are_named_in_the_shape_its_sdk_prints(gateway, changes, param):
    r = send(gateway, "pipecat-cartesia", **changes)
    body = r.json()
    assert r.status_code == body["status_code"] == 400 and body["param"] == param, body
    assert body["title"] == "Invalid request" and body["error_code"] == "invalid_request" and body["message"]


def test_cartesia_sse_is_raw_only_and_a_big_body_is_refused_by_size(gateway):
    r = send(gateway, "sdk-sse", output_format={"container": "wav", "encoding": "pcm_s16le", "sample_rate": 8000})
    assert r.status_code == 400 and r.json()["param"] == "output_format.container"
    r = send(gateway, "sdk-generate", transcript="x" * 70_000)
    assert r.status_code == 413 and r.json()["title"] and r.json()["status_code"] == 413


@pytest.mark.parametrize(
    ("name", "speech_format", "rate"),
    [("sdk-stream", "pcm", 16000), ("sdk-convert-with-timestamps", "pcm", 24000), ("sdk-stream-with-timestamps",
     "pcm_mulaw", 8000)],
)  # fmt: skip
def test_elevenlabs_audio_is_the_speech_routes(gateway, name, speech_format, rate):
    r = send(gateway, name)
    assert r.status_code == 200, r.text
    if name.endswith("with-timestamps"):
        lines = [json.loads(line) for line in r.text.splitlines() if line] if "stream" in name else [r.json()]
        data = b"".join(base64.b64decode(line["audio_base64"]) for line in lines)
        assert all(line["alignment"] is None for line in lines[:-1])
        aligned = lines[-1]["alignment"]
        assert "".join(aligned["characters"]) == SAY
        starts, ends = aligned["character_start_times_seconds"], aligned["character_end_times_seconds"]
        assert np.all(np.diff(starts) >= 0) and all(e >= s for s, e in zip(starts, ends, strict=True))
        seconds = len(data) / (2 if speech_format == "pcm" else 1) / rate
        assert starts[0] == 0 and ends[-1] == pytest.approx(seconds, abs=2e-3)
    else:
        assert r.headers["content-type"].startswith("audio/")
        data = r.content
    expected = speech(gateway, response_format=speech_format, sample_rate=rate)
    if speech_format == "pcm":
        assert np.abs(pcm(data) - pcm(expected)).max() <= 1
    assert len(data) == len(expected)


def test_livekits_synthesize_gets_mp3_at_the_rate_it_names(gateway):
    import io

    import av

    r = send(gateway, "livekit-elevenlabs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/"), r.text
    with av.open(io.BytesIO(r.content)) as container:
        assert container.streams.audio[0].rate == 22050


@pytest.mark.parametrize(
    ("query", "changes", "param"),
    [
        ({"output_format": "pcm_11025"}, {}, "output_format"),
        ({"output_format": "mp3_44100_320"}, {}, "output_format"),
        ({}, {"text": ""}, "text"),
        ({}, {"voice_settings": {"speed": 9.0}}, "voice_settings.speed"),
        ({}, {"voice_settings": {"loudness": 1}}, "voice_settings"),
        ({}, {"language_code": "tlh"}, "language_code"),
        ({}, {"colour": "blue"}, "colour"),
    ],
)
def test_elevenlabs_refusals_are_named_in_its_shape(gateway, query, changes, param):
    call = CALLS["sdk-convert"]
    r = httpx.post(f"{gateway}/v1/text-to-speech/default", params=query or call.query, headers=ours(call.headers),
                   json={**ours(call.body), **OURS, **changes}, timeout=60)  # fmt: skip
    detail = r.json()["detail"]
    assert r.status_code == 400 and detail["param"] == param and detail["status"] == "invalid_request", detail
    assert param.split(".")[-1] in detail["message"] or param == "voice_settings"


def test_an_unknown_elevenlabs_voice_is_named(gateway):
    call = CALLS["sdk-convert"]
    r = httpx.post(f"{gateway}/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM", headers=ours(call.headers),
                   json=ours(call.body), timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["detail"]["param"] == "voice_id"


def test_models_and_voices_in_each_sdks_shape(gateway):
    for name, (_, _, path, headers, _) in GETS.items():
        r = httpx.get(gateway + path, headers=ours(headers), timeout=30)
        assert r.status_code == 200, (name, r.text)
        if name == "sdk-models":
            assert r.json()[0]["model_id"] == "fireredtts3"
        elif name == "openai-models":
            assert r.json()["data"][0]["id"] == "fireredtts3"
        else:
            voices = r.json()["voices"]
            assert {"voice_id", "name", "category"} <= set(voices[0]) and voices[0]["voice_id"] == "default"
