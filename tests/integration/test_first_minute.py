"""What a newcomer meets in the first minute, through the OpenAI SDK of today (openai 3.57): a gateway
started before its tritonserver answers "server starting" (503, Retry-After) and then serves at once;
every stock voice name and ``{"id": ...}``; the SDK's own voices methods; a FLAC that libsndfile reads;
``x-request-id`` on every answer."""

from __future__ import annotations

import io
import socket
import time
import typing

import httpx
import numpy as np
import pytest
import soundfile as sf

from client.aio import RECONNECT_MAX_MS
from gateway.errors import STARTING
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import stop_later

pytestmark = pytest.mark.integration
# compared byte for byte: chunk sizes move float32 rounding, so fixed ones
SHORT = {"max_patches": 6, "chunk_first": 1, "chunk_next": 2, "chunk_fixed": True, "seed": 3}


@pytest.fixture(scope="module")
def sdk(gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key="not-checked", max_retries=0, timeout=60)


def speech(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json={"input": "First minute", "response_format": "pcm", **SHORT,
                                                      **body}, timeout=60)  # fmt: skip


def grpc_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_gateway_started_before_tritonserver_says_starting_then_serves_at_once(tiny_ckpt, tmp_path):
    """The launcher starts both at once: until tritonserver answers, a request gets 503 "server starting"
    with Retry-After (never the transport's words); the first request after tritonserver is ready is served,
    and so is every later one (gRPC's default backoff kept refusing for ~17 s here)."""
    from gateway.server import in_thread

    ports = Ports.free()
    with in_thread(f"127.0.0.1:{ports.grpc}") as url:
        for _ in range(8):  # failures in a row: with gRPC's default backoff the retries spread out
            r = speech(url)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["message"] == STARTING and "Connection refused" not in r.text
            assert httpx.get(f"{url}/health", timeout=10).json()["error"]["message"] == STARTING
            time.sleep(0.5)
        repo = build(tmp_path / "model_repository",
                     ServeOptions(checkpoint=str(tiny_ckpt), slots=2, max_len=256, cancel_dir=str(tmp_path / "cancel"),
                                  voice_dir=str(tmp_path / "voices"), run_dir=str(tmp_path)))  # fmt: skip
        srv = TritonServer(repo, tmp_path, ports).start()
        try:
            while not (srv.is_ready() and grpc_listens(ports.grpc)):
                # the window in which it loads its models: "starting" (or served: gRPC opens before HTTP)
                r = speech(url)
                assert r.status_code == 200 or (r.status_code == 503 and r.json()["error"]["message"] == STARTING), (
                    r.status_code, r.text[:300])  # fmt: skip
                time.sleep(0.25)
            # ready: the very next request is served. The channel retries a refused connection at least every
            # RECONNECT_MAX_MS, and a failed request drops it, so no backoff is left to wait out.
            assert RECONNECT_MAX_MS <= 1000
            statuses = [speech(url).status_code for _ in range(4)]
            assert statuses == [200] * 4
            assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        finally:
            stop_later(srv)


def test_every_stock_voice_of_the_sdk_and_the_id_form(sdk, server):
    """Each name in the SDK's own literal for ``voice`` speaks (the default voice here); a registered voice
    answers by name and as ``{"id": name}``, the SDK's custom-voice form."""
    from openai.types.audio import speech_create_params

    literal = next(a for a in typing.get_args(speech_create_params.Voice) if typing.get_origin(a) is typing.Literal)
    stock = typing.get_args(literal)
    assert {"marin", "cedar", "alloy"} <= set(stock)
    default = sdk.audio.speech.create(model="tts-1", voice="default", input="First minute", response_format="pcm",
                                      extra_body=SHORT).content  # fmt: skip
    for name in stock:
        got = sdk.audio.speech.create(model="tts-1", voice=name, input="First minute", response_format="pcm",
                                      extra_body=SHORT).content  # fmt: skip
        assert got == default, name
    clip = (0.1 * np.random.default_rng(11).standard_normal(24000)).astype(np.float32)
    wav = io.BytesIO()
    sf.write(wav, clip, 24000, format="WAV")
    admin = sdk.with_options(api_key=server.admin_key)
    made = admin.audio.voices.create(audio_sample=("me.wav", wav.getvalue(), "audio/wav"), name="first-minute",
                                     consent="cons_local")  # fmt: skip
    try:
        by_name = sdk.audio.speech.create(model="tts-1", voice="first-minute", input="First minute",
                                          response_format="pcm", extra_body=SHORT).content  # fmt: skip
        by_id = sdk.audio.speech.create(model="tts-1", voice={"id": made.id}, input="First minute",
                                        response_format="pcm", extra_body=SHORT).content  # fmt: skip
        assert by_id == by_name != default
    finally:
        admin.audio.voices.delete(made.id)


def test_the_sdks_voices_methods_create_list_and_delete(sdk, server, gateway):
    """``audio.voices.create`` (``audio_sample``, ``name``, ``consent`` as the SDK sends them), the list,
    and ``audio.voices.delete``, answered in OpenAI's shapes; the admin key is still the rule."""
    import openai

    clip = (0.1 * np.random.default_rng(12).standard_normal(24000)).astype(np.float32)
    wav = io.BytesIO()
    sf.write(wav, clip, 24000, format="WAV")
    sample = ("ref.wav", wav.getvalue(), "audio/wav")
    with pytest.raises(openai.PermissionDeniedError):  # the SDK's key is not the admin key
        sdk.audio.voices.create(audio_sample=sample, name="sdk-voice", consent="cons_x")
    admin = sdk.with_options(api_key=server.admin_key)
    voice = admin.audio.voices.create(audio_sample=sample, name="sdk-voice", consent="cons_x")
    assert (voice.id, voice.name, voice.object, voice.type) == ("sdk-voice", "sdk-voice", "audio.voice", "audio_sample")
    assert voice.created_at > 0
    listed = httpx.get(f"{gateway}/v1/audio/voices", timeout=10).json()
    assert listed["object"] == "list" and "sdk-voice" in [v["id"] for v in listed["data"]]
    deleted = admin.audio.voices.delete("sdk-voice")
    assert (deleted.id, deleted.deleted, deleted.object) == ("sdk-voice", True, "audio.voice.deleted")
    with pytest.raises(openai.NotFoundError):
        admin.audio.voices.delete("sdk-voice")


def test_a_flac_stream_is_read_by_libsndfile(sdk, gateway):
    """``soundfile.read`` refused the streamed FLAC ("array is too big": no total length in STREAMINFO)."""
    with sdk.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="First minute",
                                                         response_format="flac", extra_body=SHORT) as r:  # fmt: skip
        data = b"".join(r.iter_bytes())
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    pcm = np.frombuffer(speech(gateway).content, "<i2")
    assert rate == 24000 and np.array_equal(audio, pcm)


def test_every_answer_has_an_x_request_id(gateway):
    ok, refused = speech(gateway), speech(gateway, voice="nobody")
    assert ok.status_code == 200 and refused.status_code == 400
    ids = [r.headers.get("x-request-id") for r in (ok, refused, httpx.get(f"{gateway}/v1/models", timeout=10))]
    assert all(ids) and len(set(ids)) == 3
    echoed = httpx.get(f"{gateway}/health", headers={"x-request-id": "mine-42"}, timeout=10)
    assert echoed.headers["x-request-id"] == "mine-42"


def test_speed_is_a_keyword_of_every_streaming_call(server):
    """``speed=`` on the sync client (gRPC and HTTP), the asyncio client and ``edit``'s keywords: the audio of
    ``parameters={"speed": ...}``, which the server time-stretches."""
    import asyncio

    from client import AsyncTTSClient, TTSClient

    params = {k: v for k, v in SHORT.items() if k != "seed"}
    grpc = TTSClient(f"127.0.0.1:{server.ports.grpc}")
    as_parameter = grpc.synthesize("First minute", seed=3, parameters={**params, "speed": 1.5})
    plain = grpc.synthesize("First minute", seed=3, parameters=params)
    assert as_parameter.size < plain.size  # faster: shorter
    http = TTSClient(f"127.0.0.1:{server.ports.http}", "http")

    async def via_asyncio():
        async with AsyncTTSClient(f"127.0.0.1:{server.ports.grpc}") as tts:
            return await tts.synthesize("First minute", seed=3, parameters=params, speed=1.5)

    for got in (grpc.synthesize("First minute", seed=3, parameters=params, speed=1.5),
                http.synthesize("First minute", seed=3, parameters=params, speed=1.5),
                asyncio.run(via_asyncio())):  # fmt: skip
        assert got.size == as_parameter.size and np.allclose(got, as_parameter, atol=1e-6)
    with pytest.raises(ValueError, match="disagree"):
        grpc.synthesize("First minute", parameters={"speed": 2.0}, speed=1.5)
