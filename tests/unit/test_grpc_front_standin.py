"""serving.fronts.grpc_front against a stand-in upstream (a grpc.aio server of raw bytes on loopback): what it
forwards, what it refuses, and what it does with a stream whose client never reads. The real path,
tritonserver behind the front, is tests/integration/test_grpc_front.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from serving.fronts.front_limits import FrontLimits, default_max_message_mb
from serving.fronts.grpc_front import ENDED_COUNTER, SERVICE, GrpcFront, forwarded_metadata
from serving.fronts.metrics_relay import LAUNCHER
from serving.supervision.triton_env import free_port

CHUNK = 32 * 1024  # bytes of each streamed response of the stand-in


class Upstream:
    """A stand-in for Triton's gRPC service: ServerLive echoes its request and the ``x-probe`` metadata it
    got, ModelInfer fails NOT_FOUND, ModelReady waits for :meth:`release`, ModelStreamInfer sends CHUNK-byte responses until cancelled (``cancelled`` is set then)."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.metadata: list[tuple] = []
        self.cancelled = threading.Event()
        self.sent = 0
        self.held = 0  # ModelReady calls waiting for release()
        self.held_at_live: list[int] = []  # per ServerLive call, in arrival order: ModelReady calls held then
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        self.released = asyncio.Event()

        async def live(request, context):
            self.held_at_live.append(self.held)
            self.metadata.append(tuple(context.invocation_metadata()))
            return b"echo:" + request

        async def infer(request, context):
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")

        async def hold(request, context):
            self.held += 1
            try:
                await self.released.wait()
            finally:
                self.held -= 1
            return b"released"

        async def stream(requests, context):
            # Nothing ends this call but its caller (no deadline, no last response): any end is a cancel.
            # gRPC reports one in a write as CancelledError, or, when the cancel lands while the write's
            # batch is in core, as that batch's ExecuteBatchError (seen on CI).
            await requests.__anext__()
            try:
                while True:
                    await context.write(b"a" * CHUNK)
                    self.sent += 1
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            except Exception:
                self.cancelled.set()

        handlers = {"ServerLive": grpc.unary_unary_rpc_method_handler(live),
                    "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
                    "ModelReady": grpc.unary_unary_rpc_method_handler(hold),
                    "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}  # fmt: skip
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    def release(self) -> None:
        """End the ModelReady calls waiting (and let the next ones through)."""
        self.loop.call_soon_threadsafe(self.released.set)

    def hold_again(self) -> None:
        self.loop.call_soon_threadsafe(self.released.clear)

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


@contextmanager
def stream_never_read(address: str) -> Iterator[grpc.Future]:
    """A ModelStreamInfer call that sends one request, keeps its request side open until the block ends, and
    reads nothing unless the test does (on a channel without BDP pings, so the windows stay as they start)."""
    hold = threading.Event()

    def requests():
        yield b"start"
        hold.wait()

    with grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(requests())
        try:
            yield call
        finally:
            call.cancel()
            hold.set()


def test_a_stream_whose_client_never_reads_is_ended_and_its_upstream_cancelled(front):
    f, upstream = front
    ended = LAUNCHER.values[ENDED_COUNTER]
    with stream_never_read(f.address):
        assert upstream.cancelled.wait(30), f"upstream still streaming after {upstream.sent} responses"
        sent = upstream.sent
        # the front read on past the client's window up to its bound, and no further than the bound and the
        # flow-control windows between the front and upstream
        assert LIMITS.unsent_bytes / CHUNK <= sent <= (LIMITS.unsent_bytes + 4 * 2**20) / CHUNK, sent
        assert LAUNCHER.values[ENDED_COUNTER] == ended + 1
        wait_until(lambda: not f.streams, "the cut stream's handler is still there")  # dropped CUT_GRACE later


def test_a_client_that_reads_again_after_the_cut_gets_the_bound_named(front):
    f, upstream = front
    ended = LAUNCHER.values[ENDED_COUNTER]
    with stream_never_read(f.address) as call:
        wait_until(lambda: LAUNCHER.values[ENDED_COUNTER] > ended, "the stream was not ended")
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:  # what was in flight, then the status
                pass
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


# ---- the connection bounds, each at a small size: what a client sees ----
# (one client here: its share is all of max_calls; the share's own tests are in test_grpc_front_calls)
BOUNDED = FrontLimits(max_connections=2, max_streams_per_connection=2, max_calls=3, max_calls_per_client=3, idle_seconds=2.0,
                      handshake_seconds=1.0, keepalive_seconds=1.0, keepalive_timeout_seconds=2.0)  # fmt: skip
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, SETTINGS_ACK = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
PING, GOAWAY = 6, 7


@pytest.fixture
def bounded():
    """A front with BOUNDED in front of a stand-in of its own (ModelReady calls hold until released)."""
    upstream = Upstream()
    front = GrpcFront("127.0.0.1", free_port(), f"127.0.0.1:{upstream.port}", BOUNDED).start()
    yield front, upstream
    upstream.release()
    front.close(grace=0)
    upstream.close()


def connection(address: str) -> grpc.Channel:
    """A channel of its own: one TCP connection (channels to one address otherwise share one)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def held(channel: grpc.Channel, upstream: Upstream, n: int) -> list[grpc.Future]:
    """``n`` more ModelReady calls on ``channel``, once the upstream holds them."""
    before = upstream.held
    calls = [method(channel, "ModelReady").future(b"", timeout=60) for _ in range(n)]
    wait_until(lambda: upstream.held == before + n, f"the upstream holds {upstream.held} calls, not {before + n}")
    return calls


def wait_until(done, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def frames_until_closed(sock: socket.socket, acknowledge: bool, seconds: float = 30.0) -> list[tuple[int, int, bytes]]:
    """The HTTP/2 frames (type, flags, payload) the front sends on ``sock`` until it closes it (AssertionError
    if it is still open after ``seconds``); its SETTINGS acknowledged if ``acknowledge``."""
    sock.settimeout(seconds)
    data, frames = b"", []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"still open after {seconds:g} s; frames: {frames}") from None
        if not chunk:
            return frames
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + (size := int.from_bytes(data[:3], "big")):
            frames.append((data[3], data[4], data[9 : 9 + size]))
            if acknowledge and data[3] == 4 and not data[4] & 1:
                sock.sendall(SETTINGS_ACK)
            data = data[9 + size :]


def goaway_text(frames) -> bytes:
    (payload,) = [p for kind, _, p in frames if kind == GOAWAY]
    return payload[8:]  # after the last stream id and the error code


def test_a_connection_past_max_connections_is_closed_and_one_comes_free_when_one_ends(bounded):
    f, upstream = bounded
    first, second = connection(f.address), connection(f.address)
    calls = held(first, upstream, 1) + held(second, upstream, 1)  # two connections, each busy (not idle)
    with connection(f.address) as third:
        with pytest.raises(grpc.RpcError) as e:
            method(third, "ServerLive")(b"x", timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    upstream.release()
    assert [c.result() for c in calls] == [b"released"] * 2
    first.close()

    def a_new_connection_is_served() -> bool:
        with connection(f.address) as channel:
            try:
                return method(channel, "ServerLive")(b"y", timeout=5) == b"echo:y"
            except grpc.RpcError:  # the front has not yet seen the first one go
                return False

    wait_until(a_new_connection_is_served, "no connection came free after one closed")
    second.close()


def test_a_call_past_max_streams_per_connection_waits_for_one_to_end(bounded):
    """HTTP/2 MAX_CONCURRENT_STREAMS: the client holds its third call back (nothing is refused) until one of
    the two open on that connection ends; another connection is served meanwhile."""
    f, upstream = bounded
    with connection(f.address) as channel, connection(f.address) as other:
        calls = held(channel, upstream, 2)
        third = method(channel, "ServerLive").future(b"3", timeout=60)
        assert method(other, "ServerLive")(b"other", timeout=30) == b"echo:other"
        assert not third.done() and upstream.held_at_live == [2]  # only the other connection's call got there
        upstream.release()
        assert [c.result() for c in calls] == [b"released"] * 2
        assert third.result() == b"echo:3"
        # The third reached the upstream only once a held call had ended (each leaves the count before its
        # answer goes out): let through at once, it would have found both held.
        assert len(upstream.held_at_live) == 2 and upstream.held_at_live[1] < 2, upstream.held_at_live


def advertised_settings(address: str, seconds: float = 30.0) -> dict[int, int]:
    """The front's HTTP/2 SETTINGS (identifier -> value), read off a raw connection."""
    with socket.create_connection(("127.0.0.1", int(address.rpartition(":")[2]))) as sock:
        sock.sendall(PREFACE + SETTINGS)
        sock.settimeout(seconds)
        data = b""
        while True:
            while len(data) >= 9 and len(data) >= 9 + (size := int.from_bytes(data[:3], "big")):
                kind, flags, payload = data[3], data[4], data[9 : 9 + size]
                if kind == 4 and not flags & 1:  # SETTINGS, not an acknowledgement: 6 bytes a setting
                    return {int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(payload[i + 2 : i + 6], "big")
                            for i in range(0, len(payload), 6)}  # fmt: skip
                data = data[9 + size :]
            chunk = sock.recv(65536)
            assert chunk, "the front closed the connection before its SETTINGS"
            data += chunk


def test_the_front_tells_each_connection_its_stream_bound(bounded):
    """What makes a client hold a call back: SETTINGS_MAX_CONCURRENT_STREAMS (0x3) is the bound."""
    f, _ = bounded
    assert advertised_settings(f.address).get(0x3) == BOUNDED.max_streams_per_connection == 2


def test_a_call_past_max_calls_is_refused(bounded):
    f, upstream = bounded
    with connection(f.address) as channel, connection(f.address) as other:
        calls = held(channel, upstream, 2) + held(other, upstream, 1)
        with pytest.raises(grpc.RpcError) as e:
            method(other, "ServerLive")(b"x", timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        upstream.release()
        assert [c.result() for c in calls] == [b"released"] * 3
        assert method(other, "ServerLive")(b"x", timeout=30) == b"echo:x"  # the count went down


def test_a_connection_that_never_sends_the_http2_preface_is_closed(bounded):
    f, upstream = bounded
    with socket.create_connection(("127.0.0.1", int(f.address.rpartition(":")[2]))) as sock:
        sock.sendall(PREFACE[:10])  # a start, never finished
        frames = frames_until_closed(sock, acknowledge=False)
    assert b"handshake" in goaway_text(frames), frames  # the handshake bound (1 s), before the idle one (2 s)


def test_an_idle_connection_is_closed(bounded):
    f, upstream = bounded
    with socket.create_connection(("127.0.0.1", int(f.address.rpartition(":")[2]))) as sock:
        sock.sendall(PREFACE + SETTINGS)  # a complete handshake, then no call
        frames = frames_until_closed(sock, acknowledge=True)
    assert b"idle" in goaway_text(frames), frames
    with connection(f.address) as channel:  # a client's channel: the call, then idle, then a new connection
        assert method(channel, "ServerLive")(b"1", timeout=30) == b"echo:1"
        wait_until(lambda: channel._channel.check_connectivity_state(False) == 0, "the channel is still connected")
        assert method(channel, "ServerLive")(b"2", timeout=30) == b"echo:2"  # it reconnects by itself


class Relay:
    """A TCP relay between one client and the front that drops the client's ping acknowledgements (a peer
    gone silent but for its calls) while ``answer_pings`` is False; ``pings``: those the front sent."""

    def __init__(self, target: tuple[str, int], answer_pings: bool):
        self.target, self.answer_pings, self.pings = target, answer_pings, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = threading.Event()  # the front closed its side
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        front = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(client, front, True), daemon=True).start()
        self._pipe(front, client, False)

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        data, skip = b"", len(PREFACE) if from_client else 0
        while True:
            try:
                chunk = src.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                if not from_client:
                    self.closed.set()
                for s in (src, dst):
                    s.close()
                return
            data, out = data + chunk, b""
            if skip:
                out, data, skip = data[:skip], data[skip:], max(0, skip - len(data))
            while len(data) >= 9 and len(data) >= 9 + (size := int.from_bytes(data[:3], "big")):
                frame, data = data[: 9 + size], data[9 + size :]
                self.pings += not from_client and frame[3] == PING and not frame[4] & 1
                if not (from_client and frame[3] == PING and frame[4] & 1 and not self.answer_pings):
                    out += frame
            try:
                dst.sendall(out)
            except OSError:
                return


@pytest.mark.parametrize("answer_pings", [True, False], ids=["answered", "unanswered"])
def test_keepalive_pings_a_busy_connection_and_closes_it_when_they_go_unanswered(bounded, answer_pings):
    f, upstream = bounded
    relay = Relay(("127.0.0.1", int(f.address.rpartition(":")[2])), answer_pings=True)
    with grpc.insecure_channel(relay.address) as channel:
        (call,) = held(channel, upstream, 1)
        relay.answer_pings = answer_pings  # from now on (a loaded machine may take a while to get here)
        if answer_pings:  # pinged every keepalive_seconds, and kept
            wait_until(lambda: relay.pings >= 3, f"{relay.pings} pings")
            assert not relay.closed.is_set()
            upstream.release()
            assert call.result() == b"released"
        else:  # closed keepalive_timeout_seconds after the ping, its call ended and the upstream's cancelled
            assert relay.closed.wait(30)
            assert call.exception(30).code() == grpc.StatusCode.UNAVAILABLE
            wait_until(lambda: upstream.held == 0, "the upstream's call was not cancelled")
