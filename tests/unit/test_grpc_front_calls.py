"""The gRPC front's bounds on calls (serving.fronts.call_ids, front_limits.AddressShares and the call-idle bound
of serving.fronts.grpc_front): sequence ids private to each stream call, a client's share of the calls, and
the end of a call that holds nothing. Against a stand-in upstream whose stream echoes each request as Triton
got it; the real path is tests/integration/test_front_calls.py."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest
from tritonclient.grpc import service_pb2

from loadtest.source_relay import SourceRelay
from serving.fronts.call_ids import MAX_SEQUENCES, CallIds
from serving.fronts.front_limits import AddressShares, FrontLimits
from serving.fronts.grpc_front import IDLE_COUNTER, SERVICE, GrpcFront, _log, client_address
from serving.fronts.metrics_relay import LAUNCHER
from serving.supervision.triton_env import free_port


def request(sequence: int | str = 0, start: bool = False, end: bool = False, model: str = "tts",
            raw: bytes = b"") -> bytes:  # fmt: skip
    """A ModelInferRequest as tritonclient writes one (its sequence parameters only when ``sequence``)."""
    r = service_pb2.ModelInferRequest(model_name=model, id="r1")
    r.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(raw or b"\x05\x00\x00\x00Hello")
    if sequence:
        if isinstance(sequence, str):
            r.parameters["sequence_id"].string_param = sequence
        else:
            r.parameters["sequence_id"].int64_param = sequence
        r.parameters["sequence_start"].bool_param = start
        r.parameters["sequence_end"].bool_param = end
    return r.SerializeToString()


def sequence_of(message: bytes) -> int | str:
    p = service_pb2.ModelInferRequest.FromString(message).parameters["sequence_id"]
    return getattr(p, p.WhichOneof("parameter_choice"))


# ---- the ids, without a server ----
def test_two_calls_with_one_client_id_get_different_ids_and_a_call_keeps_its_own():
    a, b = CallIds(), CallIds()
    a_start, b_start = sequence_of(a.rewrite(request(7, start=True))), sequence_of(b.rewrite(request(7, start=True)))
    assert a_start != b_start and 7 not in (a_start, b_start) and a_start > 0 and b_start > 0
    assert sequence_of(a.rewrite(request(7))) == a_start and sequence_of(b.rewrite(request(7))) == b_start
    assert sequence_of(a.rewrite(request(7, end=True))) == a_start  # END goes to the stream, then retires it


def test_an_id_the_call_never_started_or_ended_names_a_fresh_id_each_time():
    ids = CallIds()
    started = sequence_of(ids.rewrite(request(7, start=True)))
    unknown = {sequence_of(ids.rewrite(request(8))) for _ in range(20)} | {
        sequence_of(ids.rewrite(request(8, end=True)))
    }
    assert len(unknown) == 21 and started not in unknown and 8 not in unknown
    ids.rewrite(request(7, end=True))
    after_end = sequence_of(ids.rewrite(request(7)))
    assert after_end != started and not ids.open


def test_a_second_start_on_an_open_id_keeps_its_id_and_start_with_end_retires_at_once():
    ids = CallIds()
    first = sequence_of(ids.rewrite(request(7, start=True)))
    assert sequence_of(ids.rewrite(request(7, start=True))) == first  # tts refuses it as an open stream's
    one_shot = sequence_of(ids.rewrite(request(9, start=True, end=True)))
    assert one_shot != first and list(ids.open) == [7]


def test_the_table_is_bounded_and_drops_the_oldest():
    ids = CallIds()
    mapped = [sequence_of(ids.rewrite(request(i, start=True))) for i in range(1, MAX_SEQUENCES + 6)]
    assert len(ids.open) == MAX_SEQUENCES
    assert sequence_of(ids.rewrite(request(1))) != mapped[0]  # dropped: now unknown
    assert sequence_of(ids.rewrite(request(MAX_SEQUENCES + 5))) == mapped[-1]


def test_string_ids_stay_strings_and_other_fields_pass_unchanged():
    ids = CallIds()
    raw = bytes(range(256)) * 64
    out = service_pb2.ModelInferRequest.FromString(ids.rewrite(request("victim", start=True, raw=raw)))
    assert isinstance(sequence_of(out.SerializeToString()), str) and sequence_of(out.SerializeToString()) != "victim"
    assert (out.model_name, out.id, out.raw_input_contents[0], out.inputs[0].name) == ("tts", "r1", raw, "TEXT")
    assert out.parameters["sequence_start"].bool_param
    plain = request()
    assert ids.rewrite(plain) == plain and ids.rewrite(b"\xff\xff not a message") == b"\xff\xff not a message"


def test_client_address_drops_the_port():
    assert client_address("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert client_address("ipv6:[::1]:51234") == "[::1]"
    assert client_address("unix:/tmp/s") == "unix:/tmp/s"


def test_a_share_refuses_past_it_and_comes_free():
    shares = AddressShares(2, _log, "gRPC call")
    assert shares.enter("a") and shares.enter("a") and shares.enter("b") and not shares.enter("a")
    assert shares.held == {"a": 2, "b": 1}
    shares.leave("a")
    assert shares.enter("a") and AddressShares(0, _log, "gRPC call").enter("a")  # 0: no share
    assert FrontLimits(max_calls=40).calls_per_client == 10 and FrontLimits().calls_per_client == 0
    assert FrontLimits(max_calls=40, max_calls_per_client=3).calls_per_client == 3
    assert FrontLimits().for_places(40).calls_per_client == 28
    with pytest.raises(ValueError, match="--grpc-front-call-idle-seconds"):  # a text stream between pieces
        FrontLimits(call_idle_seconds=30).for_places(40, text_idle_seconds=30)


# ---- through the front ----
class EchoUpstream:
    """A stand-in for Triton's gRPC service: each request of a stream is answered by its own bytes as they
    came (what Triton got), but for model "hold", never answered; ModelReady waits for ``released``."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        self.released = asyncio.Event()

        async def stream(requests, context):
            async for message in requests:
                if service_pb2.ModelInferRequest.FromString(message).model_name != "hold":
                    await context.write(message)

        async def hold(message, context):
            await self.released.wait()
            return b"released"

        handlers = {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream),
                    "ModelReady": grpc.unary_unary_rpc_method_handler(hold)}  # fmt: skip
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    def close(self):
        self.loop.call_soon_threadsafe(self.released.set)
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


IDLE = 1.0  # seconds: the call-idle bound here
LIMITS = FrontLimits(max_calls=20, max_calls_per_client=2, call_idle_seconds=IDLE)


@pytest.fixture
def front():
    upstream = EchoUpstream()
    front = GrpcFront("127.0.0.1", free_port(), f"127.0.0.1:{upstream.port}", LIMITS).start()
    yield front
    front.close(grace=0)
    upstream.close()


class Call:
    """One ModelStreamInfer call on a channel of its own: ``send`` a request, ``answer()`` the next response."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.requests: queue.Queue = queue.Queue()
        self.responses = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(
            iter(self.requests.get, None), timeout=20
        )

    def send(self, message: bytes) -> None:
        self.requests.put(message)

    def answer(self) -> bytes:
        return next(self.responses)

    def close(self) -> None:
        self.responses.cancel()
        self.requests.put(None)
        self.channel.close()


def test_two_calls_with_one_id_reach_upstream_under_different_ids(front):
    victim, attacker = Call(front.address), Call(front.address)
    try:
        victim.send(request(42, start=True))
        victim_id = sequence_of(victim.answer())
        victim.send(request(42))
        assert sequence_of(victim.answer()) == victim_id
        attacker.send(request(42))
        attacker.send(request(42, end=True))
        assert victim_id not in {sequence_of(attacker.answer()), sequence_of(attacker.answer())}
    finally:
        victim.close()
        attacker.close()


def test_a_call_that_holds_nothing_is_ended_and_one_waiting_for_an_answer_is_not(front):
    idle, waiting, ended = Call(front.address), Call(front.address), LAUNCHER.values[IDLE_COUNTER]
    try:
        idle.send(request(5))  # answered at once (a refused piece), then the call is kept open
        idle.answer()
        waiting.send(request(6, start=True, model="hold"))  # never answered: it holds its request upstream
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            idle.answer()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--grpc-front-call-idle-seconds" in e.value.details() and f"{IDLE:g} s" in e.value.details()
        assert time.monotonic() - t0 < IDLE + 5 and LAUNCHER.values[IDLE_COUNTER] == ended + 1
        later = Call(front.address)  # idle from after the waiting call's request: the check that ends it
        try:  # saw the waiting call longer without an answer than the bound
            later.send(request(7))
            later.answer()
            with pytest.raises(grpc.RpcError):
                later.answer()
        finally:
            later.close()
        deadline = time.monotonic() + 30
        while len(front.streams) > 1:  # the ended calls' handlers finish
            assert time.monotonic() < deadline, front.streams
            time.sleep(0.05)
        assert LAUNCHER.values[IDLE_COUNTER] == ended + 2 and len(front.streams) == 1  # the waiting call is still there
        assert front.shares.held == {"127.0.0.1": 1}  # the ended calls left their client's share
    finally:
        idle.close()
        waiting.close()


def test_a_client_past_its_share_is_refused_by_name_while_another_client_is_served(front):
    port = int(front.address.rpartition(":")[2])
    relay = SourceRelay(("127.0.0.1", port), source="127.0.0.2")
    mine = [grpc.insecure_channel(relay.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    try:
        held = [c.unary_unary(f"/{SERVICE}/ModelReady").future(b"", timeout=60) for c in mine[:2]]
        deadline = time.monotonic() + 30
        while front.shares.held.get("127.0.0.2", 0) < 2:
            assert time.monotonic() < deadline, front.shares.held
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:  # a third call, on a connection of its own: the same client
            mine[2].unary_unary(f"/{SERVICE}/ModelReady")(b"", timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details().startswith("unavailable: this client (127.0.0.2) has 2 calls in progress")
        assert "--grpc-front-max-calls-per-client 2" in e.value.details()
        other = Call(front.address)  # another client (127.0.0.1) is served meanwhile
        other.send(request(1, start=True))
        assert sequence_of(other.answer()) != 1
        other.close()
        assert not any(h.done() for h in held)
    finally:
        for c in mine:
            c.close()
        relay.close()


def test_parameters_after_the_tensors_or_a_cut_message_are_handled():
    tensors = service_pb2.ModelInferRequest(model_name="tts", raw_input_contents=[b"\x00" * 1000]).SerializeToString()
    params = service_pb2.ModelInferRequest()
    params.parameters["sequence_id"].int64_param = 7
    params.parameters["sequence_start"].bool_param = True
    message = tensors + params.SerializeToString()  # a protobuf message may put its fields in any order
    out = service_pb2.ModelInferRequest.FromString(CallIds().rewrite(message))
    assert out.raw_input_contents == [b"\x00" * 1000] and out.parameters["sequence_id"].int64_param not in (0, 7)
    assert CallIds().rewrite(message[:-3]) == message[:-3]  # not a message: Triton refuses it as it came
