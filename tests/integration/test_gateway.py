"""The OpenAI-compatible gateway (gateway/) on uvicorn, in front of a real tritonserver: every format
decodes to the tts model's audio, errors come in OpenAI's shape, a client that leaves frees the stream."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import av
import httpx
import numpy as np
import pytest

from client import TTSClient
from client.voices import VoiceClient
from serving.triton_env import free_port
from tests.integration.conftest import wait_gauges_zero

pytestmark = pytest.mark.integration
EXTRAS = {"seed": 7, "max_patches": 8, "chunk_first": 1, "chunk_next": 2}


@pytest.fixture(scope="module")
def gateway(server):
    import uvicorn

    from gateway.app import create_app

    port = free_port()
    config = uvicorn.Config(create_app(f"127.0.0.1:{server.ports.grpc}"), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def reference(server):
    """The tts model's audio for the request the tests send, as 16-bit PCM would carry it."""
    audio = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize(
        "Through the gateway", seed=7, parameters={k: v for k, v in EXTRAS.items() if k != "seed"}
    )
    return np.clip(audio, -1, 1)


def speech(gateway, **body):
    return httpx.post(f"{gateway}/v1/audio/speech", json={"model": "fireredtts3", "input": "Through the gateway",
                                                           **EXTRAS, **body}, timeout=60)  # fmt: skip


def decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as c:
        frames = [f for f in c.decode(audio=0)]
    rate = frames[0].sample_rate
    pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float64)
    name = frames[0].format.name
    scale = {"s16": 32767.0, "s32": 32767.0 * 65536}.get(name.rstrip("p"), 1.0)
    return (pcm / scale).astype(np.float32), rate


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm"])
def test_lossless_formats_carry_the_tts_audio_exactly(gateway, reference, fmt):
    r = speech(gateway, response_format=fmt)
    assert r.status_code == 200, r.text
    if fmt == "pcm":
        pcm, rate = np.frombuffer(r.content, "<i2").astype(np.float32) / 32767.0, 24000
    else:
        pcm, rate = decode(r.content)
    assert rate == 24000 and pcm.shape == reference.shape
    assert np.array_equal(np.round(pcm * 32767), np.round(reference * 32767))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_lossy_formats_decode_to_the_same_length(gateway, reference, fmt):
    r = speech(gateway, response_format=fmt)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith({"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}[fmt])
    pcm, rate = decode(r.content)
    seconds = pcm.size / rate
    assert abs(seconds - reference.size / 24000) < 0.1  # codec priming and padding only


def test_sse_stream_carries_the_same_bytes(gateway):
    plain = speech(gateway, response_format="pcm").content
    r = speech(gateway, response_format="pcm", stream_format="sse")
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == plain


def test_audio_streams_before_the_utterance_ends(gateway):
    t0 = time.monotonic()
    with httpx.stream("POST", f"{gateway}/v1/audio/speech", timeout=60,
                      json={"input": "A long one", "response_format": "pcm", "max_patches": 200,
                            "chunk_first": 1, "chunk_next": 1}) as r:  # fmt: skip
        first = next(r.iter_bytes())
        t_first = time.monotonic() - t0
    assert first and t_first < 5  # 200 patches take far longer than the first one


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"voice": "nobody-registered"}, 400, "voice"),
        ({"response_format": "ogg-vorbis"}, 400, "response_format"),
        ({"speed": 1.5}, 400, "speed"),
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 5000}, 400, "input"),
        ({"colour": "blue"}, 400, "colour"),
        ({"seed": "seven"}, 400, "seed"),
        ({"stream_format": "ws"}, 400, "stream_format"),
        ({"steps": 0}, 400, None),  # refused by the server: its message names steps
        ({"max_patches": 2.5}, 400, None),
    ],
)
def test_errors_in_openai_shape(gateway, body, status, param):
    r = speech(gateway, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] and error["message"] and error["param"] == param
    if param is None:
        assert next(iter(body)) in error["message"]


def test_bad_bodies(gateway):
    r = httpx.post(f"{gateway}/v1/audio/speech", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway}/v1/audio/speech", content=b"x" * 100_000, timeout=10)
    assert r.status_code == 413

    def chunked():  # no Content-Length: the cap holds while the body is read
        for _ in range(100):
            yield b"x" * 10_000

    r = httpx.post(f"{gateway}/v1/audio/speech", content=chunked(), timeout=10)
    assert r.status_code == 413 and "headers" not in r.json()["error"]["message"]


def test_stock_and_registered_voices(gateway, server, reference):
    default = speech(gateway, response_format="pcm").content
    assert speech(gateway, response_format="pcm", voice="alloy").content == default  # stock name: default voice
    clip = (0.1 * np.random.default_rng(5).standard_normal(24000)).astype(np.float32)
    VoiceClient(f"127.0.0.1:{server.ports.grpc}", admin_key=server.admin_key).add("gw-voice", clip, 24000, "x")
    time.sleep(5.1)  # the gateway reuses a voice list for 5 s
    listed = httpx.get(f"{gateway}/v1/audio/voices", timeout=10).json()["voices"]
    assert "gw-voice" in [v["name"] for v in listed]
    r = speech(gateway, response_format="pcm", voice="gw-voice")
    assert r.status_code == 200 and r.content != default
    VoiceClient(f"127.0.0.1:{server.ports.grpc}", admin_key=server.admin_key).remove("gw-voice")


def test_models_and_health(gateway):
    assert httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"] == "fireredtts3"
    assert httpx.get(f"{gateway}/health", timeout=10).json() == {"status": "ok"}


def test_a_client_that_leaves_frees_the_stream(gateway, server):
    with httpx.stream("POST", f"{gateway}/v1/audio/speech", timeout=60,
                      json={"input": "Left early", "response_format": "mp3", "max_patches": 400,
                            "chunk_first": 1, "chunk_next": 1}) as r:  # fmt: skip
        next(r.iter_bytes())
    m = wait_gauges_zero(server, 20)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_an_unreachable_server_is_503_with_retry_after():
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from serving.triton_env import free_port

    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:  # nothing listens there
        r = client.post("/v1/audio/speech", json={"input": "Anyone there?"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_unavailable"
        assert client.get("/health").status_code == 503


def test_voice_upload_and_delete_need_the_admin_key(gateway, server):
    import soundfile as sf

    wav = io.BytesIO()
    sf.write(wav, (0.1 * np.random.default_rng(9).standard_normal(24000)).astype(np.float32), 24000, format="WAV")
    form = {"name": "uploaded", "text": "an uploaded voice"}

    def upload(headers, data=wav.getvalue()):
        return httpx.post(f"{gateway}/v1/audio/voices", data=form, files={"file": ("ref.wav", data)},
                          headers=headers, timeout=60)  # fmt: skip

    admin = {"Authorization": f"Bearer {server.admin_key}"}
    assert upload({}).status_code == 401
    assert upload({"Authorization": "Bearer wrong"}).status_code == 403
    assert upload(admin, bytes(21 * 2**20)).status_code == 413  # over the 20 MB cap
    r = upload(admin, b"not audio at all")
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = upload(admin)
    assert r.status_code == 200 and r.json()["name"] == "uploaded", r.text
    assert "uploaded" in [v["name"] for v in httpx.get(f"{gateway}/v1/audio/voices", timeout=10).json()["voices"]]
    assert speech(gateway, response_format="pcm", voice="uploaded").status_code == 200
    assert httpx.delete(f"{gateway}/v1/audio/voices/uploaded", timeout=10).status_code == 401
    assert httpx.delete(f"{gateway}/v1/audio/voices/uploaded", headers=admin, timeout=10).status_code == 200
    r = httpx.delete(f"{gateway}/v1/audio/voices/uploaded", headers=admin, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "name"
    assert speech(gateway, voice="uploaded").json()["error"]["param"] == "voice"


def test_the_web_page_and_the_get_form_of_speech(gateway):
    page = httpx.get(f"{gateway}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/audio/speech" in page.text and "/v1/audio/voices" in page.text
    posted = speech(gateway, response_format="wav").content
    query = {"input": "Through the gateway", "response_format": "wav", **{k: str(v) for k, v in EXTRAS.items()}}
    got = httpx.get(f"{gateway}/v1/audio/speech", params=query, timeout=60)
    assert got.status_code == 200 and got.content == posted  # what the page's audio element plays
    bad = httpx.get(f"{gateway}/v1/audio/speech", params={**query, "max_patches": "lots"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_patches"
