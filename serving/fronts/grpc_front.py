"""A bounded gRPC front for Triton (docs/triton.md#T22): it forwards every call of
``inference.GRPCInferenceService`` to Triton's own gRPC port on loopback, as raw bytes, within
:class:`serving.fronts.front_limits.FrontLimits`. What it reads, each bound and why, the cut of a stream
whose client does not read (CUT_GRACE) and the costs: docs/operations.md#the-grpc-front."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc
import grpc.aio

from engine.protocol import INVALID, UNAVAILABLE
from serving.fronts.call_ids import CallIds
from serving.fronts.front_limits import AddressShares, FrontLimits
from serving.fronts.metrics_relay import LAUNCHER, FrontLoop

SERVICE = "inference.GRPCInferenceService"
STREAM_METHOD = "ModelStreamInfer"  # the one streaming method; every other is unary
ENDED_COUNTER = LAUNCHER.add("tts_grpc_front_streams_ended_total", "gRPC streams the front ended because their "
                             "client did not take their responses (--grpc-front-max-unsent-mb / -seconds)")  # fmt: skip
IDLE_COUNTER = LAUNCHER.add("tts_grpc_front_calls_ended_idle_total", "gRPC stream calls the front ended because "
                            "they held nothing (--grpc-front-call-idle-seconds)")  # fmt: skip
REFUSED_COUNTER = LAUNCHER.add("tts_grpc_front_calls_refused_total", "gRPC calls the front refused because their "
                               "client had its share of calls in progress (--grpc-front-max-calls-per-client)")  # fmt: skip
CUT_GRACE = 5.0  # seconds a cut stream's client has to take what it was sent before its handler is dropped
_log = logging.getLogger("grpc_front")


# Triton is ours and on loopback: no message bound towards it (the front bounded what comes in), and
# after a restart it is reached again within a second.
UPSTREAM_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]  # fmt: skip
_HOP_HEADERS = ("user-agent", "content-type", "te", "host")  # set by the front's own channel


def client_address(peer: str) -> str:
    """gRPC's peer (``ipv4:10.0.0.7:51234``, ``ipv6:[::1]:51234``, ``unix:/path``) -> the client's address,
    without its port (one client may open many connections)."""
    kind, _, rest = peer.partition(":")
    return (rest.rpartition(":")[0] or rest) if kind in ("ipv4", "ipv6") else peer


def forwarded_metadata(metadata) -> tuple[tuple[str, str | bytes], ...]:
    """The client's metadata as Triton should see it: without HTTP/2 pseudo-headers and gRPC's own."""
    return tuple((k, v) for k, v in metadata or () if not (k.startswith((":", "grpc-")) or k in _HOP_HEADERS))


class _Outbox:
    """One stream's responses read from Triton that its client has not taken yet (raw messages)."""

    def __init__(self, client: str):
        self.client = client  # the client's address (for the log)
        self.moved_at = time.monotonic()  # when a request last came from the client or a response from Triton
        self.asked = False  # a request went to Triton after its last response: the call holds something
        self.items: collections.deque[bytes] = collections.deque()
        self.bytes = 0
        self.ready = asyncio.Event()
        self.end: tuple[grpc.StatusCode, str, tuple] | None = None  # how the client's stream ends
        self.writing_since = 0.0  # monotonic time the write in progress began (0: none)
        self.cut_at = 0.0  # monotonic time the bound ended the stream (0: it did not)
        self.handler: asyncio.Task | None = None  # the stream's handler (cancelled if its write never ends)

    def put(self, message: bytes) -> None:
        self.moved_at, self.asked = time.monotonic(), False
        self.items.append(message)
        self.bytes += len(message)
        self.ready.set()

    def finish(self, code: grpc.StatusCode, details: str = "", trailing: tuple = ()) -> None:
        if self.end is None:
            self.end = (code, details, trailing)
        self.ready.set()

    def stalled(self, now: float) -> float:
        """Seconds the client has taken nothing while a response waits for it (the write in progress)."""
        return now - self.writing_since if self.writing_since else 0.0

    def idle(self, now: float) -> float:
        """Seconds the call has held nothing: every request answered, nothing waiting for its client."""
        if self.end is not None or self.asked or self.items or self.writing_since:
            return 0.0
        return now - self.moved_at


class GrpcFront(FrontLoop):
    """The front on ``host:port``, forwarding to Triton's gRPC at ``upstream`` (``127.0.0.1:PORT``)."""

    def __init__(self, host: str, port: int, upstream: str, limits: FrontLimits):
        super().__init__("grpc-front", host, port)
        self.address, self.upstream, self.limits = f"{host}:{port}", upstream, limits
        self.streams: set[tuple[_Outbox, grpc.aio.Call]] = set()
        self.shares = AddressShares(self.limits.calls_per_client, _log,
                                    "gRPC call (--grpc-front-max-calls-per-client)")  # fmt: skip

    async def _start(self) -> None:
        from tritonclient.grpc import service_pb2

        self.channel = grpc.aio.insecure_channel(self.upstream, options=UPSTREAM_OPTIONS)
        self.stream_call = self.channel.stream_stream(f"/{SERVICE}/{STREAM_METHOD}")
        methods = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods  # every one
        handlers = {m.name: grpc.unary_unary_rpc_method_handler(self._unary(m.name)) for m in methods}
        handlers[STREAM_METHOD] = grpc.stream_stream_rpc_method_handler(self._stream)
        # a unary call naming a sequence is passed on as it is: only tts takes text-in streams, and Triton
        # refuses a unary call to a decoupled model before the model sees it
        self.server = grpc.aio.server(options=self.limits.server_options(),
                                      maximum_concurrent_rpcs=self.limits.max_calls or None)  # fmt: skip
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        if not self.server.add_insecure_port(self.address):
            raise OSError(f"the gRPC front cannot listen on {self.address}")
        await self.server.start()

    async def _enter(self, context: grpc.aio.ServicerContext) -> str:
        """Count the call against its client's share -> the client's address; a call past it is aborted."""
        client = client_address(context.peer())
        if not self.shares.enter(client):
            LAUNCHER.increment(REFUSED_COUNTER)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{UNAVAILABLE}this client ({client}) has {self.shares.held[client]} calls in progress, "
                                f"its share of the server's (--grpc-front-max-calls-per-client "
                                f"{self.shares.share}); end one first")  # fmt: skip
        return client

    # ---- unary calls: one message each way ----
    def _unary(self, name: str):
        upstream = self.channel.unary_unary(f"/{SERVICE}/{name}")

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            client = await self._enter(context)
            try:
                return await upstream(request, metadata=forwarded_metadata(context.invocation_metadata()),
                                      timeout=context.time_remaining())  # fmt: skip
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "", forwarded_metadata(e.trailing_metadata()))
            finally:
                self.shares.leave(client)

        return forward

    # ---- the stream: requests forwarded as they come, responses as the client takes them ----
    async def _stream(self, requests, context: grpc.aio.ServicerContext) -> None:
        outbox, ids = _Outbox(await self._enter(context)), CallIds()
        outbox.handler = asyncio.current_task()

        async def forward_requests():
            async for request in requests:
                outbox.moved_at, outbox.asked = time.monotonic(), True
                yield ids.rewrite(request)

        call = entry = pump = None
        try:
            call = self.stream_call(forward_requests(), metadata=forwarded_metadata(context.invocation_metadata()),
                                    timeout=context.time_remaining())  # fmt: skip
            self.streams.add(entry := (outbox, call))
            pump = asyncio.ensure_future(self._pump(call, outbox))
            while True:
                await outbox.ready.wait()
                if outbox.items:
                    message = outbox.items.popleft()
                    outbox.bytes -= len(message)
                    outbox.writing_since = time.monotonic()
                    await context.write(message)
                    outbox.writing_since = 0.0
                elif outbox.end is not None:
                    break
                else:
                    outbox.ready.clear()
            code, details, trailing = outbox.end
            if code != grpc.StatusCode.OK:
                await context.abort(code, details, trailing)
            context.set_trailing_metadata(trailing)
        finally:  # the client left, or the stream ended: nothing of it stays upstream
            self.shares.leave(outbox.client)
            self.streams.discard(entry)
            for task in (call, pump):
                if task is not None:
                    task.cancel()

    async def _pump(self, call, outbox: _Outbox) -> None:
        """Triton's responses -> ``outbox``, as fast as Triton sends them; then how the stream ended."""
        try:
            async for message in call:
                outbox.put(message)
                if outbox.bytes > self.limits.unsent_bytes:
                    self._cut(outbox, call)
                    return
            outbox.finish(grpc.StatusCode.OK, "", forwarded_metadata(await call.trailing_metadata()))
        except grpc.aio.AioRpcError as e:
            outbox.finish(e.code(), e.details() or "", forwarded_metadata(e.trailing_metadata()))

    def _cut(self, outbox: _Outbox, call) -> None:
        """End a stream whose client does not take its responses: Triton's call cancelled, what waits dropped."""
        if outbox.end is not None:
            return
        waiting, stalled, limits = outbox.bytes, outbox.stalled(time.monotonic()), self.limits
        outbox.items.clear()
        outbox.bytes, outbox.cut_at = 0, time.monotonic()
        self._end(outbox, call, ENDED_COUNTER,
                  f"{INVALID}the client did not take this stream's responses ({waiting / 2**20:.1f} MiB waiting, "
                  f"nothing taken for {stalled:.0f} s; the front's bounds: {limits.max_unsent_mb:g} MiB waiting, "
                  f"{limits.max_unsent_seconds:g} s without taking any: --grpc-front-max-unsent-mb, "
                  f"--grpc-front-max-unsent-seconds); the stream was ended",
                  "ended a gRPC stream whose client did not read: %.1f MiB waiting, nothing taken for %.0f s",
                  waiting / 2**20, stalled)  # fmt: skip

    def _end(self, outbox: _Outbox, call, counter: str, message: str, *log) -> None:
        """End a stream call by a bound: Triton's call cancelled, the client told ``message``, counted, logged."""
        call.cancel()
        outbox.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        LAUNCHER.increment(counter)
        _log.warning(*log)

    def _reap(self, now: float) -> None:
        """End the streams whose client took nothing for ``max_unsent_seconds`` and the calls that held nothing
        for ``call_idle_seconds``; drop the handler of a cut stream whose client still takes nothing CUT_GRACE s on."""
        for outbox, call in list(self.streams):
            if outbox.end is None and outbox.stalled(now) > self.limits.max_unsent_seconds:
                self._cut(outbox, call)
            elif (idle := outbox.idle(now)) > (seconds := self.limits.call_idle_seconds):
                self._end(outbox, call, IDLE_COUNTER,
                          f"{INVALID}this call held nothing for {idle:.0f} s (every request answered, no response "
                          f"waiting; the front's bound: {seconds:g} s, --grpc-front-call-idle-seconds); the call was "
                          "ended: open a new one for the next request",
                          "ended a gRPC stream call from %s that held nothing for %.0f s (%d calls of this client "
                          "in progress)", outbox.client, idle, self.shares.held[outbox.client])  # fmt: skip
            elif outbox.cut_at and outbox.writing_since and now - outbox.cut_at > CUT_GRACE:
                outbox.handler.cancel()

    async def _stop(self, grace: float) -> None:
        await self.server.stop(grace)
        await self.channel.close()
