"""Where every agent socket starts, whatever its vendor: what the gateway's sockets share (:class:`Sockets`:
the text streams, the voices, the bounds, one count of open sockets for all vendors) and the handshake
(:func:`serve`: admitted within the socket bounds, or refused by name, then run by the core,
:class:`gateway.text_socket.TextSocket`, in the socket's dialect)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.outbox import log
from gateway.shares import StreamShares, held_text
from gateway.socket_bounds import TRY_AGAIN_LATER, OpenSockets, SocketBounds
from gateway.text_socket import Dialect, TextSocket
from gateway.text_streams import TextStreams


@dataclass(frozen=True)
class Sockets:
    """What every agent socket of the gateway shares, whatever its vendor."""

    open_text: TextStreams
    voices: Callable[[], Awaitable[list[dict]]]
    bounds: SocketBounds
    open_sockets: OpenSockets  # in all and by peer address: one share for every vendor's sockets
    unsent_seconds: float  # the audio a socket's peer may leave untaken (gateway.outbox)
    shares: StreamShares  # Triton streams open by address, the HTTP routes' too: each context holds one


async def serve(ws, dialect: Dialect, sockets: Sockets, bounds: SocketBounds | None = None,
                refusal: tuple[int, str, int] | None = None) -> None:  # fmt: skip
    """Accept ``ws`` and run it in ``dialect``, within the gateway's socket bounds (``bounds``: this socket's,
    when its dialect narrows them); ``refusal`` (status, message, close code): the dialect refused the
    handshake (a bad query parameter): the socket gets that error, then is closed."""
    host = ws.client.host if ws.client else "unknown"
    peer = f"{host}:{ws.client.port}" if ws.client else host
    # counted before the first await: the next connection sees it
    if refusal is None and (full := sockets.open_sockets.take(host)) is not None:
        log.warning("an agent socket from %s refused: %s", peer, full)
        refusal = (503, full, TRY_AGAIN_LATER)
    if refusal is not None:
        status, message, code = refusal
        with contextlib.suppress(Exception):  # a new socket's buffers are empty: this cannot wait long
            await ws.accept()
            reply = json.dumps(dialect.error(None, status, message))
            async with asyncio.timeout(sockets.bounds.send_seconds):
                await ws.send_text(reply)
            async with asyncio.timeout(sockets.bounds.send_seconds):
                await ws.close(code)
        return
    try:
        await ws.accept()
        open_text = held_text(sockets.open_text, sockets.shares, host)  # each context holds the address's share
        await TextSocket(ws, dialect, open_text, sockets.voices, bounds or sockets.bounds,
                         sockets.unsent_seconds, peer).run()  # fmt: skip
    finally:
        sockets.open_sockets.leave(host)
