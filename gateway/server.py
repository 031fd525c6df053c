"""The gateway's HTTP server: uvicorn (h11), with every connection bounded in time and their number bounded.

A connection must send a request's complete headers within ``header_timeout`` seconds of opening, and
of each response (uvicorn has no such timeout: 60 connections trickling a byte now and then stayed open
for as long as they liked); it may sit idle between requests for ``keep_alive_timeout`` seconds
(uvicorn's own); a request body must arrive within ``body_timeout`` seconds (:func:`gateway.body.read_capped`,
408). With ``limit_concurrency`` connections open, or as many requests running, uvicorn answers a
new request with a plain-text 503 (``Connection: close``) instead of running it.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.wsproto_impl import WSProtocol

from gateway.body import BODY_TIMEOUT
from gateway.budget import Bounds
from gateway.cartesia import MAX_MESSAGE_CHARS
from gateway.outbox import ABORT

# Each connection's kernel send buffer (Linux doubles it for its bookkeeping). Left to autotuning it grew to
# 2.8 MB on loopback for a client that did not read: 58 s of 24 kHz PCM held below the gateway's own
# bound on unsent audio (gateway.outbox). 64 KB still carries 640 KB/s at 100 ms round trips, several
# times the fattest audio format (96 KB/s).
SEND_BUFFER_BYTES = 64 * 1024
# A WebSocket frame larger than this closes the socket (1009) before it is read; a smaller one over
# MAX_MESSAGE_CHARS characters gets the named error. UTF-8 takes up to 4 bytes a character.
WS_MAX_BYTES = 4 * MAX_MESSAGE_CHARS + 4096


@dataclass(frozen=True)
class ServerOptions:
    header_timeout: float = 10.0  # seconds to a request's complete headers, from connecting or the last response
    keep_alive_timeout: float = 5.0  # seconds a connection may sit idle between requests
    body_timeout: float = BODY_TIMEOUT  # seconds for a request's body, once its headers are in
    limit_concurrency: int = 256  # connections open (or requests running) before new requests get 503
    bounds: Bounds = Bounds()  # totals over the requests in flight, and each stream's unsent audio

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout", "limit_concurrency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a timer from the connection's start, and from each response, to the
    next request's complete headers: a client that trickles them (each byte resets the keep-alive timer)
    is disconnected when it runs out. Subclass with ``header_timeout`` set (:func:`header_timeout_protocol`)."""

    header_timeout: float = ServerOptions.header_timeout

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # what a client that stops reading leaves in our kernel (see SEND_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.scope is not None:  # a request's routes may cut its connection (gateway.outbox.Cut)
            self.scope.setdefault("extensions", {}).setdefault(ABORT, self.transport.abort)
        # A request whose headers are in is owed a response (h11: our side must send one); a body still
        # coming is read_capped's to bound.
        if self.conn.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY):
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_header_timer()  # first: the base class goes on to a pipelined request, if one is in
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class AbortableWSProtocol(WSProtocol):
    """uvicorn's wsproto WebSocket, with ``scope["extensions"][ABORT]``: the agent socket cuts a peer that
    does not read (gateway.outbox.Cut) instead of closing politely, which waits on a send buffer that never
    drains."""

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        self.scope["extensions"][ABORT] = self.transport.abort


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})


def uvicorn_config(triton: str, host: str, port: int, options: ServerOptions = ServerOptions(),
                   timeout: float = 60.0, log_level: str = "info", random_weights: bool = False,
                   socket_bounds=None, jobs=None) -> uvicorn.Config:  # fmt: skip
    """The gateway for Triton's gRPC endpoint ``triton``, served on ``host:port``; ``socket_bounds``: the agent
    WebSocket's (``gateway.socket_bounds.SocketBounds``; None: its defaults); ``jobs``: the job API's
    (``gateway.jobs.options.JobOptions``; None: no job routes)."""
    from gateway.app import create_app

    app = create_app(triton, timeout, options.body_timeout, random_weights, socket_bounds, options.bounds, jobs)
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=header_timeout_protocol(options.header_timeout), ws=AbortableWSProtocol, ws_max_size=WS_MAX_BYTES,
        timeout_keep_alive=options.keep_alive_timeout, limit_concurrency=options.limit_concurrency,
    )  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    ap.add_argument("--header-timeout", type=float, default=d.header_timeout,
                    help="seconds a connection has to send a request's headers (from connecting, and from each "
                         "response); then it is closed")  # fmt: skip
    ap.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                    help="seconds a connection may sit idle between requests")  # fmt: skip
    ap.add_argument("--body-timeout", type=float, default=d.body_timeout,
                    help="seconds a request body (JSON or upload) has to arrive in; then 408")  # fmt: skip
    ap.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                    help="connections open or requests running at once; beyond, new requests get 503")  # fmt: skip
    ap.add_argument("--max-upload-mb-in-flight", type=float, default=d.bounds.upload_bytes / 2**20,
                    help="MB of request bodies all requests in flight may hold together; beyond, 503")  # fmt: skip
    ap.add_argument("--max-decoded-mb-in-flight", type=float, default=d.bounds.decoded_bytes / 2**20,
                    help="MB of decoded uploads (float32 audio) all requests in flight may hold; beyond, 503")  # fmt: skip
    ap.add_argument("--max-unsent-seconds", type=float, default=d.bounds.unsent_seconds,
                    help="seconds of audio a connection's client may leave untaken (an agent socket: all its "
                         "contexts together); beyond, its streams are ended and the connection cut")  # fmt: skip
    ap.add_argument("--streams-per-peer", type=int, default=d.bounds.streams_per_peer,
                    help="Triton streams (speech requests, agent-socket contexts, edits) open at once from one "
                         "client address; beyond, 429 'too many streams from your address'")  # fmt: skip


def add_socket_arguments(ap: argparse.ArgumentParser) -> None:
    """The agent socket's bounds an operator is likely to set (the others: gateway.socket_bounds' defaults)."""
    from gateway.socket_bounds import SocketBounds

    d = SocketBounds()
    ap.add_argument("--agent-sockets", type=int, default=d.sockets,
                    help="agent sockets (/tts/websocket) open at once; beyond, 'too many sockets'")  # fmt: skip
    ap.add_argument("--agent-sockets-per-peer", type=int, default=d.sockets_per_peer,
                    help="agent sockets open at once from one client address; beyond, 'too many sockets from "
                         "your address'")  # fmt: skip
    ap.add_argument("--agent-send-seconds", type=float, default=d.send_seconds,
                    help="seconds an agent socket's reply may wait for its peer to take it; then the socket is cut")  # fmt: skip


def socket_bounds(args: argparse.Namespace):
    from gateway.socket_bounds import SocketBounds

    return SocketBounds(sockets=args.agent_sockets, sockets_per_peer=args.agent_sockets_per_peer,
                        send_seconds=args.agent_send_seconds)  # fmt: skip


def options(args: argparse.Namespace) -> ServerOptions:
    bounds = Bounds(int(args.max_upload_mb_in_flight * 2**20), int(args.max_decoded_mb_in_flight * 2**20),
                    args.max_unsent_seconds, args.streams_per_peer)  # fmt: skip
    return ServerOptions(args.header_timeout, args.keep_alive_timeout, args.body_timeout, args.limit_concurrency,
                         bounds)  # fmt: skip


@contextlib.contextmanager
def in_thread(triton: str, random_weights: bool = False, socket_bounds=None,
              options: ServerOptions = ServerOptions(), jobs=None) -> Iterator[str]:  # fmt: skip
    """The gateway in front of the Triton gRPC address ``triton``, served by a thread of this process on a
    free loopback port, with ``options`` (by default those of ``python -m gateway``), the agent socket's
    ``socket_bounds`` and the job API's ``jobs`` (``gateway.jobs.options.JobOptions``; None: its defaults in
    a temporary folder, removed at the end) -> its base URL (tests and benchmarks; the launcher runs
    ``python -m gateway`` as a process of its own)."""
    if jobs is None:
        from gateway.jobs.options import JobOptions

        with tempfile.TemporaryDirectory(prefix="gateway-jobs-") as folder:
            with in_thread(triton, random_weights, socket_bounds, options, JobOptions(Path(folder))) as url:
                yield url
        return
    with socket.socket() as probe:  # a free port now (the kernel's pick for port 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(
            triton,
            "127.0.0.1",
            port,
            options,
            log_level="warning",
            random_weights=random_weights,
            socket_bounds=socket_bounds,
            jobs=jobs,
        )
    )
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
