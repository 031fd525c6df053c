"""The bounded gRPC front (serving.fronts.grpc_front) in front of a real tritonserver: standard clients get what
they would get from Triton directly, byte for byte; a message past the bound is refused and the server
serves on; a stream whose client never reads is ended and its slot freed while the attacker still holds
its connection, and a legitimate stream then starts within START_WITHIN and sounds as before.

One server (2 slots, 2 waiting) with the front serves the module (conftest's ``fronted``, which test_http_front
shares: it has the HTTP front too); the tests reach Triton's own gRPC port (loopback) too, to compare."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

from client import TTSClient
from client.request import grpc_inputs, request_fields
from loadtest import attacks
from serving.fronts.grpc_front import ENDED_COUNTER
from tests.integration.helpers import GRPC_FRONT_LIMITS, LEGIT

pytestmark = pytest.mark.integration
LIMITS = GRPC_FRONT_LIMITS  # max_message_mb 2, max_unsent_mb 0.25, max_unsent_seconds 10
START_WITHIN = 10.0  # seconds: a legitimate stream's first chunk after an attack (it takes ~0.1 s here)


@pytest.fixture(scope="module")
def server(fronted):
    return fronted


@pytest.fixture(scope="module")
def front(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


@pytest.fixture(scope="module")
def legit_audio(server) -> np.ndarray:
    return TTSClient(server.triton_grpc).synthesize(**LEGIT)  # Triton's own port


def raw_stream(url: str) -> list[bytes]:
    """A tts stream's responses as the bytes on the wire (ModelInferResponse messages)."""
    fields = request_fields(LEGIT["text"], seed=LEGIT["seed"])
    request = _get_inference_request("tts", grpc_inputs(fields), "", "", None, 0, False, False, 0, None,
                                     LEGIT["parameters"])  # fmt: skip
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        responses = [r.infer_response.SerializeToString() for r in stub.ModelStreamInfer(iter([request]), timeout=60)]
    return responses


def still_serving(server, front, legit_audio) -> None:
    m = settled(server)
    assert m["tts_generator_active_slots"] == m["tts_vocoder_active_streams"] == 0, m
    chunks = [chunk.audio for chunk in TTSClient(front, timeout=START_WITHIN).stream(**LEGIT)]  # each within it
    assert np.array_equal(np.concatenate(chunks), legit_audio)


def settled(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if not any(m.get(k, 0) for k in ("tts_generator_active_slots", "tts_vocoder_active_streams",
                                         "tts_requests_in_flight")) or time.monotonic() > deadline:  # fmt: skip
            return m
        time.sleep(0.2)


def test_a_stream_through_the_front_is_byte_identical_to_one_direct(server, front, legit_audio):
    direct, through = raw_stream(server.triton_grpc), raw_stream(front)
    assert len(direct) >= 2 and through == direct  # audio, and the final response
    assert np.array_equal(TTSClient(front).synthesize(**LEGIT), legit_audio)


def test_a_text_in_stream_and_unary_calls_pass_through(server, front):
    pieces = ["Hello there. ", "A second sentence."]
    kw = {"seed": 3, "parameters": {"max_patches": 4, "chunk_first": 2, "chunk_fixed": True}}
    direct = np.concatenate([c.audio for c in TTSClient(server.triton_grpc).stream_text(pieces, **kw)])
    assert np.array_equal(np.concatenate([c.audio for c in TTSClient(front).stream_text(pieces, **kw)]), direct)
    client = grpcclient.InferenceServerClient(front)
    assert client.is_server_ready() and client.is_model_ready("tts")
    direct = grpcclient.InferenceServerClient(server.triton_grpc)
    assert client.get_model_metadata("tts") == direct.get_model_metadata("tts")
    with pytest.raises(InferenceServerException, match="admin-key"):  # restricted APIs keep their key
        client.get_model_repository_index()


def test_a_message_past_the_bound_is_refused_and_the_server_serves_on(server, front, legit_audio):
    big = np.zeros(int(LIMITS.message_bytes / 4) + 1024, np.float32)  # just past the bound as float32 samples
    fields = request_fields("Too big.", ref_audio=big, ref_sample_rate=24000, ref_text="ref", seed=1)
    client = grpcclient.InferenceServerClient(front)
    with pytest.raises(InferenceServerException) as e:
        client.infer("tts", grpc_inputs(fields))
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED", e.value
    assert f"vs. {LIMITS.message_bytes})" in e.value.message(), e.value  # gRPC names the bound
    still_serving(server, front, legit_audio)


def test_a_stream_whose_client_never_reads_is_ended_and_its_slot_freed(server, front, legit_audio):
    before = server.metrics().get(ENDED_COUNTER, 0)
    release = threading.Event()  # the attacker keeps its unread streams open until this is set
    attack = threading.Thread(target=attacks.not_reading, args=(front, 2), kwargs={"until": release}, daemon=True)
    attack.start()
    # both slots taken, then given back while the attacker still holds its connection: the front ended its
    # streams once they had max_unsent_mb waiting (or after max_unsent_seconds)
    deadline = time.monotonic() + LIMITS.max_unsent_seconds + 20
    while server.metrics().get(ENDED_COUNTER, 0) < before + 2:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.2)
    still_serving(server, front, legit_audio)  # while the attacker still holds its streams open
    release.set()
    attack.join(30)
    assert settled(server)["tts_generator_active_slots"] == 0
