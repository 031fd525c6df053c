"""The gRPC front's bounds on calls against a real tritonserver (conftest's ``fronted``): a text-in stream
belongs to the call that opened it (another call's pieces and END on its sequence id are refused as unknown,
and its audio is that of the same stream undisturbed), a client past its share of calls is refused by name
while another is served, and calls that hold nothing are ended after the call-idle bound. Issue 47, rows 3
and 5; the parts, against a stand-in: tests/unit/test_grpc_front_calls.py."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

from client import AsyncTTSClient, Chunk, TTSClient
from client.request import grpc_inputs
from loadtest.source_relay import SourceRelay
from tests.integration.helpers import GRPC_FRONT_LIMITS, LEGIT

pytestmark = pytest.mark.integration
LIMITS = GRPC_FRONT_LIMITS  # max_calls_per_client 6, call_idle_seconds 6
FIELDS = {"seed": 5, "parameters": {"max_patches": 4, "chunk_fixed": True}}
FIRST, SECOND, INJECTED = "The first sentence is here.", " And a second one.", " An injected sentence."


@pytest.fixture(scope="module")
def front(fronted) -> str:
    return f"127.0.0.1:{fronted.ports.grpc}"


def piece(sequence: int, text: str, start: bool = False, end: bool = False) -> service_pb2.ModelInferRequest:
    """A text-in request of ``sequence`` as tritonclient sends it (client.text_in's layout)."""
    return _get_inference_request("tts", grpc_inputs({"TEXT": text}), "", "", None, sequence, start, end, 0, None,
                                  None)  # fmt: skip


class RawCall:
    """A ModelStreamInfer call on a connection of its own, kept open until ``close``."""

    def __init__(self, address: str, timeout: float = 120):
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.requests: queue.Queue = queue.Queue()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.responses = stub.ModelStreamInfer(iter(self.requests.get, None), timeout=timeout)

    def send(self, request) -> None:
        self.requests.put(request)

    def answer(self) -> service_pb2.ModelStreamInferResponse:
        return next(self.responses)

    def close(self) -> None:
        self.responses.cancel()
        self.requests.put(None)
        self.channel.close()


def victim_stream(front: str, attack=None) -> np.ndarray:
    """A text-in stream through the front: FIRST (flushed), its first audio, ``attack(its sequence id)``, then
    SECOND and END -> all its audio."""

    async def go():
        async with AsyncTTSClient(front, timeout=120) as tts:
            ts = await tts.open_text(**FIELDS)
            await ts.send(FIRST, flush=True)
            audio = []
            async for item in ts:
                if isinstance(item, Chunk):
                    audio.append(item.audio)
                    break
            if attack is not None:
                await asyncio.to_thread(attack, ts.sequence)
            await ts.send(SECOND)
            await ts.end()
            audio += [item.audio async for item in ts if isinstance(item, Chunk)]
            return np.concatenate(audio)

    return asyncio.run(go())


def test_another_calls_pieces_and_end_on_a_streams_id_are_refused_and_its_audio_is_unchanged(fronted, front):
    undisturbed = victim_stream(front)
    refusals = []

    def attack(sequence: int) -> None:
        call = RawCall(front)  # another call, on a connection of its own
        try:
            for request in (
                piece(sequence, INJECTED, end=False),
                piece(sequence, "x" * 20_000),
                piece(sequence, "", end=True),
            ):
                call.send(request)
                refusals.append(call.answer().error_message)
        finally:
            call.close()
        with pytest.raises(InferenceServerException) as e:  # a unary call never reaches a stream: tts is decoupled
            grpcclient.InferenceServerClient(front).infer("tts", grpc_inputs({"TEXT": INJECTED}), sequence_id=sequence)
        refusals.append(e.value.message())

    attacked = victim_stream(front, attack)
    assert all("no open text stream" in r for r in refusals[:3]), refusals
    assert "decoupled" in refusals[3], refusals
    assert undisturbed.size > 0 and np.array_equal(attacked, undisturbed)


def test_a_client_past_its_share_is_refused_while_another_is_served_and_idle_calls_are_ended(fronted, front):
    share, idle = LIMITS.max_calls_per_client, LIMITS.call_idle_seconds
    relay = SourceRelay(("127.0.0.1", fronted.ports.grpc), source="127.0.0.2")  # the attacker's address
    calls = [RawCall(relay.address) for _ in range(share)]
    try:
        for i, call in enumerate(calls):  # each with one refused piece, then kept open
            call.send(piece(1000 + i, "x"))
            assert "no open text stream" in call.answer().error_message
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            RawCall(relay.address, timeout=30).answer()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert f"--grpc-front-max-calls-per-client {share}" in e.value.details() and "127.0.0.2" in e.value.details()
        legit = np.concatenate([c.audio for c in TTSClient(front, timeout=30).stream(**LEGIT)])  # another client
        assert legit.size > 0
        for call in calls:  # the calls that hold nothing are ended after the bound, naming it
            with pytest.raises(grpc.RpcError) as e:
                call.answer()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert "--grpc-front-call-idle-seconds" in e.value.details()
        assert idle - 3 < time.monotonic() - t0 < idle + 20
        again = RawCall(relay.address)  # the client's calls are counted no more: a new one is served
        again.send(piece(999, "x"))
        assert "no open text stream" in again.answer().error_message
        again.close()
    finally:
        for call in calls:
            call.close()
        relay.close()
