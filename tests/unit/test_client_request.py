"""Request encoding shared by the sync and asyncio clients, error mapping, and timeouts without a server."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

import client
from client import AsyncTTSClient, Forbidden, InvalidRequest, NotFound, ServerBusy, TTSClient, TTSError
from client.request import (
    TTSRequest,
    grpc_error,
    grpc_inputs,
    http_body,
    raise_if_failed,
    request_fields,
    server_error,
)
from client.voices import VoiceClient
from serving.supervision.triton_env import free_port


def test_fields_leave_out_what_is_not_given():
    assert request_fields("Hi") == {"TEXT": "Hi"}
    f = request_fields("Hi", language="French", ref_audio=[0.1, 0.2], ref_sample_rate=16000, ref_text="r", seed=0)
    assert set(f) == {"TEXT", "LANGUAGE", "REF_AUDIO", "REF_SAMPLE_RATE", "REF_TEXT", "SEED"}
    assert f["REF_AUDIO"].dtype == np.float32 and f["SEED"] == 0  # seed 0 is a seed, not "absent"


def test_every_setting_reaches_its_input_or_parameter():
    """The eleven settings of every call, written out by hand here: each lands in its input, the request
    parameters (speed among them) or the plan callback."""
    plan = print
    request = TTSRequest.of(
        "Hi", dict(language="German", ref_audio=[0.5], ref_sample_rate=16000, ref_text="r", voice_id="v", seed=3,
                   parameters={"steps": 4}, instruction="calm", task="clone", on_plan=plan, speed=1.5),
    )  # fmt: skip
    assert {k: v for k, v in request.fields.items() if k != "REF_AUDIO"} == {
        "TEXT": "Hi", "LANGUAGE": "German", "REF_SAMPLE_RATE": 16000, "REF_TEXT": "r", "VOICE_ID": "v", "SEED": 3,
        "INSTRUCTION": "calm", "TASK": "clone",
    }  # fmt: skip
    assert request.fields["REF_AUDIO"].tolist() == [0.5]
    assert request.parameters == {"steps": 4, "speed": 1.5} and request.on_plan is plan


def test_an_unknown_setting_is_refused_by_every_call_before_anything_is_sent():
    with pytest.raises(TypeError, match="'voice'.*language, ref_audio"):
        TTSRequest.of("Hi", {"voice": "alice"})
    port = free_port()  # nothing listens there: a call that got as far as sending would fail otherwise
    tts, atts = TTSClient(f"127.0.0.1:{port}"), AsyncTTSClient(f"127.0.0.1:{port}")
    for call in (lambda: tts.stream("Hi", voice="a"), lambda: tts.synthesize("Hi", voice="a"),
                 lambda: tts.stream_text(["Hi"], voice="a"), lambda: tts.edit(np.zeros(3), 8000, "x", voice="a")):  # fmt: skip
        with pytest.raises(TypeError, match="'voice'"):
            call()

    async def calls():
        for make in (lambda: atts.open_text(voice="a"), lambda: atts.synthesize("Hi", voice="a"),
                     lambda: anext(atts.stream("Hi", voice="a")), lambda: anext(atts.stream_text(["Hi"], voice="a"))):  # fmt: skip
            with pytest.raises(TypeError, match="'voice'"):
                await make()
        await atts.close()

    asyncio.run(calls())


def test_grpc_inputs_types_and_shapes():
    inputs = {
        t.name(): t for t in grpc_inputs(request_fields("Hé", ref_audio=np.zeros(5), ref_sample_rate=8000, seed=7))
    }
    assert {n: (t.datatype(), t.shape()) for n, t in inputs.items()} == {
        "TEXT": ("BYTES", [1]), "REF_AUDIO": ("FP32", [5]), "REF_SAMPLE_RATE": ("INT32", [1]), "SEED": ("INT64", [1]),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "name", "at"),
    [({"TEXT": "ok\ud800"}, "TEXT", 2), ({"TEXT": "Hi", "REF_TEXT": "\udfff a"}, "REF_TEXT", 0)],
)
def test_a_lone_surrogate_is_refused_by_name(fields, name, at):
    # JSON gives Python such strings ("\ud800"); they have no UTF-8, and gRPC strings are UTF-8
    for encode in (grpc_inputs, lambda fields: http_body(fields, {})):
        with pytest.raises(ValueError) as raised:
            encode(fields)
        assert not isinstance(raised.value, UnicodeError)
        assert str(raised.value) == f"{name} must be valid Unicode text: it contains a lone surrogate at character {at}"


def test_http_body_is_json_with_parameters():
    body = json.loads(http_body(request_fields("Hi", ref_audio=np.ones(2), ref_sample_rate=16000), {"max_patches": 6}))
    assert body == {"TEXT": "Hi", "REF_AUDIO": [1.0, 1.0], "REF_SAMPLE_RATE": 16000, "parameters": {"max_patches": 6}}


@pytest.mark.parametrize(
    "status,kind",
    [(None, InvalidRequest), ("StatusCode.INVALID_ARGUMENT", InvalidRequest), ("StatusCode.INTERNAL", InvalidRequest),
     ("StatusCode.UNAVAILABLE", InvalidRequest), ("StatusCode.DEADLINE_EXCEEDED", TimeoutError)],
)  # fmt: skip
def test_grpc_errors_keep_their_meaning(status, kind):
    e = grpc_error(InferenceServerException("invalid: LANGUAGE: unknown language 'Klingon'", status=status))
    assert type(e) is kind and "Klingon" in str(e)


@pytest.mark.parametrize("status", [None, "StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"])
def test_an_untagged_message_is_the_server_failing_or_the_transport(status):
    e = grpc_error(InferenceServerException("Socket closed", status=status))
    assert type(e) is (ConnectionError if status == "StatusCode.UNAVAILABLE" else TTSError)


@pytest.mark.parametrize(
    ("message", "cls", "text"),
    [
        ("invalid: SEED: must be an integer", InvalidRequest, "SEED: must be an integer"),
        ("unavailable: server busy: 4 requests are running or waiting (limit 4); retry shortly", ServerBusy,
         "server busy: 4 requests are running or waiting (limit 4); retry shortly"),
        ("unavailable: server is shutting down", ServerBusy, "server is shutting down"),
        ("error: vocoder: CUDA out of memory", TTSError, "vocoder: CUDA out of memory"),
        ("forbidden: the admin key is wrong", Forbidden, "the admin key is wrong"),
        ("not found: voice 'x' is not registered", NotFound, "voice 'x' is not registered"),
        ("Request for unknown model: 'tts' is not found", TTSError, "Request for unknown model: 'tts' is not found"),
        ("server busy: no tag", TTSError, "server busy: no tag"),  # the wording alone is no kind
        ("invalid:no space", TTSError, "invalid:no space"),
    ],
)  # fmt: skip
def test_the_kind_tag_picks_the_exception_and_is_not_in_the_message(message, cls, text):
    for e in (server_error(message), grpc_error(InferenceServerException(message))):
        assert type(e) is cls and str(e) == text and isinstance(e, TTSError)
        assert message.startswith(e.kind) or e.kind == "error: "
    if text != message:  # tts_ensemble: a tagged FINISH_REASON (bytes, as sent) is a failure, raised the same way
        with pytest.raises(cls) as failed:
            raise_if_failed(np.array([message.encode()], dtype=np.object_))
        assert type(failed.value) is cls and str(failed.value) == text


def test_finish_reasons_that_are_no_failure():
    for reason in ("stop", "length", "cancelled", "", None, np.array([], dtype=np.object_), "server busy: no tag"):
        assert raise_if_failed(reason) is None
    for reason in ("invalid: stop", b"invalid: stop", np.array([[b"invalid: stop"]], dtype=np.object_)):
        with pytest.raises(InvalidRequest, match="stop"):  # the same words with a kind tag are a failure
            raise_if_failed(reason)


def test_the_public_names():
    assert client.ServerUnavailable is ServerBusy
    assert {c.kind for c in (InvalidRequest, ServerBusy, TTSError, Forbidden, NotFound)} == {
        "invalid: ", "unavailable: ", "error: ", "forbidden: ", "not found: "}  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_voices_without_a_server_is_a_connection_error(protocol):
    with pytest.raises(ConnectionError):
        VoiceClient(f"127.0.0.1:{free_port()}", protocol, timeout=5).list()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_no_server_is_a_connection_error(protocol):
    with pytest.raises(ConnectionError):
        TTSClient(f"127.0.0.1:{free_port()}", protocol, timeout=5).synthesize("Hi")


def test_async_no_server_is_a_connection_error():
    async def go():
        async with AsyncTTSClient(f"127.0.0.1:{free_port()}", timeout=5) as tts:
            await tts.synthesize("Hi")

    with pytest.raises(ConnectionError):
        asyncio.run(go())


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_silent_server_times_out(silent_port, protocol):
    with pytest.raises(TimeoutError):
        TTSClient(f"127.0.0.1:{silent_port}", protocol, timeout=0.3).synthesize("Hi")


def test_async_silent_server_times_out(silent_port):
    async def go():
        async with AsyncTTSClient(f"127.0.0.1:{silent_port}", timeout=0.3) as tts:
            await tts.synthesize("Hi")

    with pytest.raises(TimeoutError):
        asyncio.run(go())


def test_bad_arguments():
    with pytest.raises(ValueError, match="protocol"):
        TTSClient("h:1", "websocket")
    with pytest.raises(ValueError, match="timeout"):
        TTSClient("h:1", timeout=0)
