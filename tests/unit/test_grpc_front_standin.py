"""serving.grpc_front against a stand-in upstream (a grpc.aio server of raw bytes on loopback): what it
forwards, what it refuses, and what it does with a stream whose client never reads. The real path,
tritonserver behind the front, is tests/integration/test_grpc_front.py."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from serving.front_limits import FrontLimits, default_max_message_mb
from serving.grpc_front import SERVICE, GrpcFront, forwarded_metadata
from serving.triton_env import free_port

CHUNK = 32 * 1024  # bytes of each streamed response of the stand-in


class Upstream:
    """A stand-in for Triton's gRPC service: ServerLive echoes its request and the ``x-probe`` metadata it
    got, ModelInfer fails NOT_FOUND, ModelStreamInfer sends CHUNK-byte responses until cancelled."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.metadata: list[tuple] = []
        self.cancelled = threading.Event()
        self.sent = 0
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        async def live(request, context):
            self.metadata.append(tuple(context.invocation_metadata()))
            return b"echo:" + request

        async def infer(request, context):
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")

        async def stream(requests, context):
            await requests.__anext__()
            try:
                while True:
                    await context.write(b"a" * CHUNK)
                    self.sent += 1
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        handlers = {"ServerLive": grpc.unary_unary_rpc_method_handler(live),
                    "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
                    "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}  # fmt: skip
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


LIMITS = FrontLimits(max_message_mb=1.0, max_unsent_mb=0.25, max_unsent_seconds=2.0)


@pytest.fixture(scope="module")
def front():
    upstream = Upstream()
    front = GrpcFront("127.0.0.1", free_port(), f"127.0.0.1:{upstream.port}", LIMITS).start()
    yield front, upstream
    front.close()
    upstream.close()


def method(channel, name):
    return channel.unary_unary(f"/{SERVICE}/{name}")


def test_unary_calls_pass_bytes_metadata_and_errors_unchanged(front):
    f, upstream = front
    with grpc.insecure_channel(f.address) as channel:
        assert method(channel, "ServerLive")(b"\x01\x02", metadata=[("x-probe", "1")]) == b"echo:\x01\x02"
        with pytest.raises(grpc.RpcError) as e:
            method(channel, "ModelInfer")(b"")
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "no such model")
    assert ("x-probe", "1") in upstream.metadata[-1]


def test_a_message_past_the_bound_is_refused_before_upstream(front):
    f, upstream = front
    seen = len(upstream.metadata)
    with grpc.insecure_channel(f.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as e:
            method(channel, "ServerLive")(bytes(2**20 + 1))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1048577" in e.value.details() and "1048576" in e.value.details()  # gRPC names both sizes
        assert method(channel, "ServerLive")(bytes(2**20 - 64))[:5] == b"echo:"  # a message within it passes
    assert len(upstream.metadata) == seen + 1


def test_a_stream_whose_client_never_reads_is_ended_and_its_upstream_cancelled(front):
    f, upstream = front
    hold = threading.Event()

    def requests():
        yield b"start"
        hold.wait()

    ended = f.ended
    with grpc.insecure_channel(f.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(requests())  # never read
        assert upstream.cancelled.wait(30), f"upstream still streaming after {upstream.sent} responses"
        sent = upstream.sent
        # the front read on past the client's window up to its bound, and no further than the bound and the
        # flow-control windows between the front and upstream
        assert LIMITS.unsent_bytes / CHUNK <= sent <= (LIMITS.unsent_bytes + 4 * 2**20) / CHUNK, sent
        assert f.ended == ended + 1
        deadline = time.monotonic() + 30
        while f.streams and time.monotonic() < deadline:  # the handler is dropped CUT_GRACE later
            time.sleep(0.2)
        assert not f.streams
        call.cancel()
        hold.set()


def test_a_client_that_reads_again_after_the_cut_gets_the_bound_named(front):
    f, upstream = front
    hold = threading.Event()

    def requests():
        yield b"start"
        hold.wait()

    ended = f.ended
    with grpc.insecure_channel(f.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(requests())
        deadline = time.monotonic() + 30
        while f.ended == ended:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:  # what was in flight, then the status
                pass
        hold.set()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--grpc-front-max-unsent-mb" in e.value.details() and "0.25 MiB waiting" in e.value.details()


def test_forwarded_metadata_drops_what_belongs_to_the_hop():
    given = [(":authority", "x"), ("user-agent", "grpc-python"), ("grpc-timeout", "1S"), ("te", "trailers"),
             ("triton-grpc-protocol-admin-key", "k"), ("x-b-bin", b"\x00")]  # fmt: skip
    assert forwarded_metadata(given) == (("triton-grpc-protocol-admin-key", "k"), ("x-b-bin", b"\x00"))


def test_the_default_message_bound_takes_the_longest_reference():
    # 60 s at 192 kHz as float32: 46,080,000 bytes, and 1 MiB for the other inputs
    assert 46_080_000 + 2**20 <= default_max_message_mb() * 2**20 < 46_080_000 + 2**20 + 2**17
    with pytest.raises(ValueError, match="max_connections"):
        FrontLimits(max_connections=0)
    assert FrontLimits().for_places(40).max_calls == 112 and FrontLimits(max_calls=5).for_places(40).max_calls == 5
