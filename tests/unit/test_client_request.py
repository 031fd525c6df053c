"""Request encoding shared by the sync and asyncio clients, error mapping, and timeouts without a server."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import AsyncTTSClient, TTSClient, TTSError
from client.request import grpc_error, grpc_inputs, http_body, request_fields
from serving.triton_env import free_port


def test_fields_leave_out_what_is_not_given():
    assert request_fields("Hi") == {"TEXT": "Hi"}
    f = request_fields("Hi", language="French", ref_audio=[0.1, 0.2], ref_sample_rate=16000, ref_text="r", seed=0)
    assert set(f) == {"TEXT", "LANGUAGE", "REF_AUDIO", "REF_SAMPLE_RATE", "REF_TEXT", "SEED"}
    assert f["REF_AUDIO"].dtype == np.float32 and f["SEED"] == 0  # seed 0 is a seed, not "absent"


def test_grpc_inputs_types_and_shapes():
    inputs = {
        t.name(): t for t in grpc_inputs(request_fields("Hé", ref_audio=np.zeros(5), ref_sample_rate=8000, seed=7))
    }
    assert {n: (t.datatype(), t.shape()) for n, t in inputs.items()} == {
        "TEXT": ("BYTES", [1]), "REF_AUDIO": ("FP32", [5]), "REF_SAMPLE_RATE": ("INT32", [1]), "SEED": ("INT64", [1]),
    }  # fmt: skip


def test_http_body_is_json_with_parameters():
    body = json.loads(http_body(request_fields("Hi", ref_audio=np.ones(2), ref_sample_rate=16000), {"max_patches": 6}))
    assert body == {"TEXT": "Hi", "REF_AUDIO": [1.0, 1.0], "REF_SAMPLE_RATE": 16000, "parameters": {"max_patches": 6}}


@pytest.mark.parametrize(
    "status,kind",
    [(None, TTSError), ("StatusCode.INVALID_ARGUMENT", TTSError), ("StatusCode.UNAVAILABLE", ConnectionError),
     ("StatusCode.DEADLINE_EXCEEDED", TimeoutError)],
)  # fmt: skip
def test_grpc_errors_keep_their_meaning(status, kind):
    e = grpc_error(InferenceServerException("LANGUAGE: unknown language 'Klingon'", status=status))
    assert type(e) is kind and "Klingon" in str(e)


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
