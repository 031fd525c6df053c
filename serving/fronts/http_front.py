"""A bounded HTTP/1.1 front for Triton's HTTP port (docs/triton.md#T22): it forwards each request to Triton's
own HTTP port on loopback, streaming both ways, within :class:`serving.fronts.front_limits.HttpFrontLimits`.
What it passes on, each bound and why: docs/operations.md#the-http-front."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus

import h11

from engine.protocol import INVALID
from serving.fronts.front_limits import HttpFrontLimits
from serving.fronts.metrics_relay import LAUNCHER, FrontLoop

CUT_COUNTER = LAUNCHER.add("tts_http_front_responses_cut_total", "HTTP responses the front cut because their "
                           "client did not take them (--http-front-max-unsent-mb / -seconds)")  # fmt: skip
# RFC 9110 7.6.1, plus the framing h11 sets itself on each side
HOP_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
               b"te", b"trailer", b"transfer-encoding", b"upgrade"}  # fmt: skip
READ_SIZE = 64 * 1024
LINGER = 2.0  # seconds an answered connection may still send before it is closed
_log = logging.getLogger("http_front")
Closed = ConnectionAbortedError  # the connection is to be closed (the reason is logged or answered): an OSError


def forwarded_headers(headers, keep_framing: bool = False) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop-by-hop ones (and those the ``Connection`` header names)."""
    named = {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")}
    out = [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS and k.lower() not in named]
    if keep_framing:  # a request: its body stays chunked on the way to Triton
        out += [(k, v) for k, v in headers if k.lower() == b"transfer-encoding"]
    return out


def error_response(status: int, message: str) -> bytes:
    """An error answer in Triton's shape, ``{"error": message}``, that closes the connection."""
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n\r\n").encode() + body  # fmt: skip


class _Client:
    """One client connection and, while it has a request in flight, its connection to Triton."""

    def __init__(self, front: HttpFront, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.front, self.reader, self.writer = front, reader, writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=front.limits.header_bytes)
        self.up: tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection] | None = None
        self.written = 0  # bytes handed to the client's transport
        self.progress = (0, time.monotonic())  # (bytes the client had taken, when that last grew)

    # ---- the client's side ----
    def send(self, event) -> None:
        data = self.conn.send(event)
        if data:
            self.written += len(data)
            self.writer.write(data)

    def unsent(self) -> int:
        return self.writer.transport.get_write_buffer_size()

    async def answer(self, status: int, message: str) -> None:
        """An error response, then close (only before the response to this request began)."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                self.writer.write(error_response(status, message))
                async with asyncio.timeout(5):
                    await self.writer.drain()
                # stop writing, and discard what the client still sends for up to LINGER seconds, so that a
                # client still sending its body reads the answer instead of a reset
                self.writer.write_eof()
                async with asyncio.timeout(LINGER):
                    while await self.reader.read(READ_SIZE):
                        pass
            except (OSError, asyncio.TimeoutError):
                pass
        raise Closed

    async def next_event(self, deadline: float | None, stall: float | None = None):
        """The client's next h11 event; Closed at ``deadline`` (monotonic) or after ``stall`` s without data."""
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                hint = e.error_status_hint
                flag = " (--http-front-max-header-kb)" if hint == 431 else ""
                await self.answer(hint, f"{INVALID}bad request: {e}{flag}")
            if event is not h11.NEED_DATA:
                return event
            limit = stall if deadline is None else deadline - time.monotonic()
            if limit is not None and limit <= 0:
                raise Closed
            try:
                async with asyncio.timeout(limit):
                    data = await self.reader.read(READ_SIZE)
            except asyncio.TimeoutError:
                raise Closed from None
            if deadline is not None and self.conn.their_state is h11.IDLE and data and not self._started:
                # the first byte of a request on a kept-alive connection: its head has header_seconds
                deadline = min(deadline, time.monotonic() + self.front.limits.header_seconds)
                self._started = True
            self.conn.receive_data(data)

    async def run(self) -> None:
        limits = self.front.limits
        deadline = time.monotonic() + limits.header_seconds
        try:
            while True:
                self._started = False
                event = await self.next_event(deadline)
                if isinstance(event, h11.ConnectionClosed):
                    return
                assert isinstance(event, h11.Request), event
                await self.forward(event)
                if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is not h11.DONE:
                    return
                self.conn.start_next_cycle()
                deadline = time.monotonic() + limits.idle_seconds
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError):
            return
        finally:
            self.close_upstream()
            self.writer.transport.abort()

    # ---- one request ----
    async def forward(self, request: h11.Request) -> None:
        limits = self.front.limits
        head = len(request.method) + len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
        if head > limits.header_bytes:  # h11 bounds only a head still incomplete: one read may bring it all
            await self.answer(431, f"{INVALID}the request head ({head / 1024:.1f} KiB) is larger than "
                              f"{limits.header_bytes / 1024:g} KiB (--http-front-max-header-kb)")  # fmt: skip
        length = dict((k.lower(), v) for k, v in request.headers).get(b"content-length")
        if length is not None and int(length) > limits.body_bytes:
            await self.answer(413, f"{INVALID}the request body ({int(length) / 2**20:.1f} MiB) is larger than "
                              f"{limits.body_bytes / 2**20:.1f} MiB (--http-front-max-body-mb)")  # fmt: skip
        if self.up is not None and self.up[0].at_eof():  # Triton closed it since the last request (it restarted)
            self.close_upstream()
        if self.up is None:
            try:
                reader, writer = await asyncio.open_connection(*self.front.upstream)
            except OSError:
                await self.answer(502, "unavailable: tritonserver is not answering yet (it is starting or restarting)")
            self.up = (reader, writer, h11.Connection(h11.CLIENT))
        up_reader, up_writer, up = self.up
        headers = forwarded_headers(request.headers, keep_framing=True)
        if not any(k.lower() == b"host" for k, _ in headers):  # an HTTP/1.0 client's request
            headers.append((b"host", "{}:{}".format(*self.front.upstream).encode()))
        up_writer.write(up.send(h11.Request(method=request.method, target=request.target, headers=headers)))
        response = asyncio.ensure_future(self.relay_response(up_reader, up))
        try:
            body = 0
            while True:
                event = await self.next_event(None, limits.idle_seconds)
                if isinstance(event, h11.Data):
                    body += len(event.data)
                    if body > limits.body_bytes:  # a chunked body past the bound
                        response.cancel()
                        self.close_upstream()
                        await self.answer(413, f"{INVALID}the request body is larger than "
                                          f"{limits.body_bytes / 2**20:.1f} MiB (--http-front-max-body-mb)")  # fmt: skip
                    if response.done():
                        break  # Triton answered before the body ended: the rest is dropped with the connection
                    up_writer.write(up.send(event))
                    await up_writer.drain()
                elif isinstance(event, h11.EndOfMessage):
                    up_writer.write(up.send(event))
                    break
                else:
                    raise Closed
            await response
        finally:
            response.cancel()
        if up.our_state is h11.DONE and up.their_state is h11.DONE:
            up.start_next_cycle()
        else:
            self.close_upstream()

    async def relay_response(self, up_reader: asyncio.StreamReader, up: h11.Connection) -> None:
        """Triton's response to the client, each piece as it comes; Closed on the unsent bound."""
        limits = self.front.limits
        while True:
            event = up.next_event()
            if event is h11.NEED_DATA:
                up.receive_data(await up_reader.read(READ_SIZE))
                continue
            if isinstance(event, (h11.InformationalResponse, h11.Response)):
                self.send(type(event)(status_code=event.status_code, headers=forwarded_headers(event.headers),
                                      reason=event.reason))  # fmt: skip
            elif isinstance(event, h11.Data):
                if self.writer.transport.is_closing():  # the client left: so does Triton's request
                    raise Closed
                self.send(event)
                if self.unsent() > limits.unsent_bytes:
                    self.front.cut(self, "bytes")
                    raise Closed
            elif isinstance(event, h11.EndOfMessage):
                self.send(h11.EndOfMessage())
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise Closed

    def close_upstream(self) -> None:
        if self.up is not None:
            self.up[1].transport.abort()
            self.up = None

    def stalled(self, now: float) -> float:
        """Seconds the client has taken nothing while some of a response waits for it."""
        waiting = self.unsent()
        taken = self.written - waiting
        if taken != self.progress[0] or not waiting:
            self.progress = (taken, now)
            return 0.0
        return now - self.progress[1]


class HttpFront(FrontLoop):
    """The front on ``host:port``, forwarding to Triton's HTTP at ``upstream`` (host, port) on loopback."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int], limits: HttpFrontLimits):
        super().__init__("http-front", host, port)
        self.upstream, self.limits = upstream, limits
        self.clients: set[_Client] = set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.clients) >= self.limits.max_connections:
            writer.write(error_response(503, f"unavailable: the server has {len(self.clients)} connections open "
                                             "(--http-front-max-connections)"))  # fmt: skip
            self.loop.call_later(1.0, writer.transport.abort)
            return
        client = _Client(self, reader, writer)
        client.task = asyncio.current_task()
        self.clients.add(client)
        try:
            await client.run()
        finally:
            self.clients.discard(client)

    def cut(self, client: _Client, why: str) -> None:
        LAUNCHER.increment(CUT_COUNTER)
        _log.warning("cut an HTTP response its client did not take (%s; %.1f MiB waiting)", why,
                     client.unsent() / 2**20)  # fmt: skip

    def _reap(self, now: float) -> None:
        """Close the connections whose client has taken nothing for ``max_unsent_seconds``."""
        for client in list(self.clients):
            if client.stalled(now) > self.limits.max_unsent_seconds:
                self.cut(client, f"nothing taken for {self.limits.max_unsent_seconds:g} s")
                client.close_upstream()
                client.writer.transport.abort()

    async def _stop(self, grace: float) -> None:
        self.server.close()
        tasks = [client.task for client in self.clients]
        for client in list(self.clients):  # each handler then ends by itself, at its next read
            client.close_upstream()
            client.writer.transport.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
