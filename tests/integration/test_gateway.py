"""The OpenAI-compatible gateway (gateway/) on uvicorn, in front of a real tritonserver: every format
decodes to the tts model's audio, errors come in OpenAI's shape, a client that leaves frees the stream."""

from __future__ import annotations

import base64
import io
import json
import time

import av
import httpx
import numpy as np
import pytest
import soxr

from client import TTSClient
from client.voices import VoiceClient
from tests.integration.helpers import metrics, wait_gauges_zero

pytestmark = pytest.mark.integration
# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
EXTRAS = {"seed": 7, "max_patches": 8, "chunk_first": 1, "chunk_next": 2, "chunk_fixed": True}


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


def test_audio_streams_before_the_utterance_ends(server, gateway):
    """The first bytes come before the utterance is made: leaving then stops it far short of its 400
    patches (python -m bench.responsiveness times the first bytes)."""
    steps = metrics(server)["tts_generator_step_seconds_count"]
    with httpx.stream("POST", f"{gateway}/v1/audio/speech", timeout=60,
                      json={"input": "A long one", "response_format": "pcm", "max_patches": 400,
                            "chunk_first": 1, "chunk_next": 1}) as r:  # fmt: skip
        first = next(r.iter_bytes())
    m = wait_gauges_zero(server, timeout=30)  # leaving the with-block closes the connection: the stream is cancelled
    assert first and m["tts_generator_active_slots"] == 0
    assert m["tts_generator_step_seconds_count"] - steps < 400  # the generator did not make the whole utterance


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"voice": "nobody-registered"}, 400, "voice"),
        ({"response_format": "ogg-vorbis"}, 400, "response_format"),
        ({"speed": 4.5}, 400, "speed"),  # OpenAI's range: 0.25..4.0
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 5000}, 400, "input"),
        ({"colour": "blue"}, 400, "colour"),
        ({"seed": "seven"}, 400, "seed"),
        ({"stream_format": "ws"}, 400, "stream_format"),
        ({"steps": 0}, 400, "steps"),  # checked as the server would: its message names steps
        ({"max_patches": 2.5}, 400, "max_patches"),
    ],
)
def test_errors_in_openai_shape(gateway, body, status, param):
    r = speech(gateway, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] and error["message"] and error["param"] == param
    assert param in error["message"]


def test_speed_over_the_gateway_and_grpc(gateway, server, sdk):
    """speed 2.0 gives half the samples of speed 1.0 for the same seed, over gRPC and over the gateway
    (the same audio on both, the OpenAI SDK's ``speed`` too); speed 1.0 is the request without speed, bit
    for bit."""
    client = TTSClient(f"127.0.0.1:{server.ports.grpc}")
    parameters = {k: v for k, v in EXTRAS.items() if k != "seed"}

    def grpc(**more):
        return client.synthesize("Through the gateway", seed=7, parameters={**parameters, **more})

    def pcm(**more):
        r = speech(gateway, response_format="pcm", **more)
        assert r.status_code == 200, r.text
        return np.frombuffer(r.content, "<i2")

    plain, normal, fast = grpc(), grpc(speed=1.0), grpc(speed=2.0)
    assert np.array_equal(normal.view(np.uint32), plain.view(np.uint32))
    assert fast.size == round(plain.size / 2) and plain.size > 10_000
    http = TTSClient(f"127.0.0.1:{server.ports.http}", protocol="http")  # Triton's generate_stream too
    assert np.array_equal(http.synthesize("Through the gateway", seed=7, parameters={**parameters, "speed": 2.0}), fast)
    assert np.array_equal(pcm(speed=1.0), pcm())
    for speed, audio in ((2.0, fast), (2, fast), (1.0, plain)):  # an int is a number too
        assert np.array_equal(pcm(speed=speed), np.round(np.clip(audio, -1, 1) * 32767).astype("<i2"))
    by_sdk = sdk.audio.speech.create(model="fireredtts3", voice="alloy", input="Through the gateway", speed=2.0,
                                     response_format="pcm", extra_body=EXTRAS).content  # fmt: skip
    assert by_sdk == pcm(speed=2.0).tobytes()


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


def test_stock_and_registered_voices(gateway, server, reference, monkeypatch):
    from gateway import app as gateway_app  # the module (``gateway`` here is the fixture's URL)

    monkeypatch.setattr(gateway_app, "VOICE_LIST_SECONDS", 0.5)  # the reuse, shortened: its wait is the point
    default = speech(gateway, response_format="pcm").content
    assert speech(gateway, response_format="pcm", voice="alloy").content == default  # stock name: default voice
    clip = (0.1 * np.random.default_rng(5).standard_normal(24000)).astype(np.float32)
    VoiceClient(f"127.0.0.1:{server.ports.grpc}", admin_key=server.admin_key).add("gw-voice", clip, 24000, "x")
    time.sleep(0.6)  # the gateway reuses a voice list for VOICE_LIST_SECONDS (5 s; 0.5 s here)
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
    from serving.supervision.triton_env import free_port

    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:  # nothing listens there
        r = client.post("/v1/audio/speech", json={"input": "Anyone there?"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
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
    query = {"input": "Through the gateway", "response_format": "wav", **{k: json.dumps(v) for k, v in EXTRAS.items()}}
    got = httpx.get(f"{gateway}/v1/audio/speech", params=query, timeout=60)
    assert got.status_code == 200 and got.content == posted  # what the page's audio element plays
    bad = httpx.get(f"{gateway}/v1/audio/speech", params={**query, "max_patches": "lots"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_patches"


# ---- the OpenAI Python SDK, as an application would use it ----
@pytest.fixture(scope="module")
def sdk(gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key="not-checked", max_retries=0, timeout=60)


def _sdk_pcm(data: bytes, fmt: str) -> np.ndarray:
    """The response decoded to float PCM at 24 kHz (Opus decodes at 48 kHz)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0
    pcm, rate = decode(data)
    return pcm if rate == 24000 else soxr.resample(pcm, rate, 24000).astype(np.float32)


def _best_correlation(a: np.ndarray, b: np.ndarray, max_lag: int = 4096) -> float:
    """Largest normalised cross-correlation of ``a`` against ``b`` over lags 0..max_lag (codec delay)."""
    n = min(a.size, b.size) - max_lag
    spectrum = np.fft.rfft(a[: n + max_lag], 2 * (n + max_lag)) * np.conj(np.fft.rfft(b[:n], 2 * (n + max_lag)))
    xc = np.fft.irfft(spectrum)[: max_lag + 1]
    energy = np.sqrt(np.convolve(a[: n + max_lag] ** 2, np.ones(n), "valid")[: max_lag + 1] * np.sum(b[:n] ** 2))
    return float(np.max(xc / energy))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_the_openai_sdk_speaks_every_format(sdk, reference, fmt):
    """``audio.speech.create`` and its streaming form give the same audio; lossless formats carry the
    gRPC audio exactly, lossy ones its length within the codec's priming and padding."""
    kw = {"model": "fireredtts3", "voice": "alloy", "input": "Through the gateway", "response_format": fmt,
          "extra_body": EXTRAS}  # fmt: skip
    whole = sdk.audio.speech.create(**kw).content
    with sdk.audio.speech.with_streaming_response.create(**kw) as response:
        assert response.http_response.headers.get("transfer-encoding") == "chunked"
        parts = list(response.iter_bytes())
    pcm = _sdk_pcm(whole, fmt)
    assert np.array_equal(_sdk_pcm(b"".join(parts), fmt), pcm)  # (Ogg's serial number is random)
    if fmt in ("flac", "wav", "pcm"):
        assert np.array_equal(np.round(pcm * 32767), np.round(reference * 32767))
    else:
        assert abs(pcm.size / 24000 - reference.size / 24000) < 0.1
        assert _best_correlation(pcm, reference) > 0.5  # the codec kept the signal, after its delay


def test_the_openai_sdk_streams_before_the_utterance_ends(sdk, server):
    """The first bytes reach the SDK while the generator is still busy with the same utterance: 1,000 patches
    (160 s of audio, near the session server's longest), more than three times the 300 with which a loaded
    make test once had the whole utterance generated before the test read its first bytes."""
    with sdk.audio.speech.with_streaming_response.create(
        model="fireredtts3", voice="default", input="A long one", response_format="pcm",
        extra_body={"max_patches": 1000, "chunk_first": 1, "chunk_next": 1},
    ) as response:  # fmt: skip
        first = next(response.iter_bytes(3840))
        assert first
        assert metrics(server)["tts_generator_active_slots"] >= 1  # still generating
    m = wait_gauges_zero(server)  # leaving the with-block closes the connection: the stream is cancelled
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


@pytest.mark.parametrize(
    ("kw", "error", "status"),
    [
        ({"voice": "nobody-registered"}, "BadRequestError", 400),
        ({"speed": 0.1}, "BadRequestError", 400),
        ({"response_format": "ogg"}, "BadRequestError", 400),
        ({"instructions": "w" * 501}, "BadRequestError", 400),  # over the limit (a design needs Instruct)
        ({"input": "y" * 4001}, "BadRequestError", 400),
    ],
)
def test_the_openai_sdk_raises_its_own_errors(sdk, kw, error, status):
    import openai

    args = {"model": "fireredtts3", "voice": "default", "input": "Hello", **kw}
    with pytest.raises(getattr(openai, error)) as e:
        sdk.audio.speech.create(**args)
    assert e.value.status_code == status
    assert e.value.body["param"] == next(iter(kw)) and e.value.body["message"]


def test_the_front_end_through_the_gateway(gateway, server):
    """``normalize`` and language detection reach the server: a text with digits and no ``language``
    gives the gRPC audio of the same request; ``normalize: false`` gives other audio."""
    text = "会议定于2024年5月5日。"
    grpc = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize(
        text, seed=7, parameters={k: v for k, v in EXTRAS.items() if k != "seed"}
    )
    got = speech(gateway, input=text, response_format="pcm").content
    assert np.array_equal(np.frombuffer(got, "<i2"), np.round(np.clip(grpc, -1, 1) * 32767).astype("<i2"))
    raw = speech(gateway, input=text, response_format="pcm", normalize=False).content
    assert raw != got
    r = speech(gateway, input="😀😀", response_format="pcm")
    assert r.status_code == 400 and "nothing to speak after cleaning" in r.json()["error"]["message"]


def test_an_upload_too_long_to_be_a_reference_is_refused_before_decoding(gateway):
    """A tiny file that would decode to hundreds of MB (10 min of stereo FLAC silence) is refused from
    its header, before the admin key is checked by the server and before any decoding."""
    import soundfile as sf

    flac = io.BytesIO()
    sf.write(flac, np.zeros((600 * 48000, 2), np.float32), 48000, format="FLAC")
    assert len(flac.getvalue()) < 2 * 2**20  # compresses to almost nothing; decodes to 230 MB
    r = httpx.post(f"{gateway}/v1/audio/voices", data={"name": "bomb", "text": "x"},
                   files={"file": ("bomb.flac", flac.getvalue())}, headers={"Authorization": "Bearer guess"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    assert "600.0 s long; a reference may be at most 60 s" in r.json()["error"]["message"]


def test_an_sse_client_that_leaves_frees_the_stream(gateway, server):
    with httpx.stream("POST", f"{gateway}/v1/audio/speech", timeout=60,
                      json={"input": "A long one", "response_format": "pcm", "stream_format": "sse",
                            "max_patches": 300, "chunk_first": 1, "chunk_next": 1}) as r:  # fmt: skip
        assert next(r.iter_lines()).startswith("data:")
        assert metrics(server)["tts_generator_active_slots"] >= 1
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
