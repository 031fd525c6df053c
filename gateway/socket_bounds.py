"""The agent socket's bounds (:mod:`gateway.text_socket`) and the names of its refusals: each refusal's
error reply starts with its name, so a client (and docs/agents.md) can tell them apart."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from gateway.errors import log
from serving.contract import DEFAULT_TEXT_IDLE_SECONDS, MAX_STREAM_CHARS
from serving.fronts.front_limits import AddressShares


@dataclass(frozen=True)
class SocketBounds:
    sockets: int = 64  # agent sockets open on the gateway at once
    # agent sockets open at once from one peer address (the client's IP, as the gateway's connection sees it:
    # behind a proxy, the proxy's): one client cannot take all the places
    sockets_per_peer: int = 16
    contexts: int = 8  # contexts open at once on one socket
    context_chars: int = MAX_STREAM_CHARS  # text one context takes in all: a text-in stream's, the server's bound
    idle_seconds: float = 300.0  # a socket without a message for this long, and no context open, is closed
    # a context waiting for more text (continue true) this long fails; before the server's own bound on a
    # text-in stream's silence (--text-idle-seconds), so that the client gets this bound's name and 408
    context_idle_seconds: float = DEFAULT_TEXT_IDLE_SECONDS - 5
    # a reply the socket's peer has not taken in this long (its buffers full: it does not read) cuts the socket
    send_seconds: float = 15.0
    # per socket: Pipecat's TOKEN mode sends each LLM token as a message (fast LLMs stream 100-500 a second)
    messages_per_second: float = 200.0  # sustained
    message_burst: int = 1000  # at once

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


# Refusals, by name (the error reply's text starts with them)
TOO_MANY_SOCKETS = "too many sockets: the server has {n} agent sockets open; retry shortly"
TOO_MANY_FROM_PEER = "too many sockets from your address: at most {n} agent sockets from one address at once"
TOO_MANY_CONTEXTS = "too many contexts: a socket has at most {n} open at once; end or cancel one first"
CONTEXT_TOO_LONG = "context text too long: a context takes at most {n} characters in all"
TOO_FAST = "too many messages: a socket takes at most {rate:g} a second (bursts of {burst})"
IDLE = "socket idle: no message for {s:g} s and no context open; closing"
CONTEXT_IDLE = "context idle: no text for {s:g} s and no continue false; it is cancelled"
BINARY = "binary frames are not read: send JSON text messages"
ENDED = "context ended: it takes no more text (it was ended); send more text under a new context id"
TRY_AGAIN_LATER = 1013  # the WebSocket close code for "try again later"
# Why a socket was cut (gateway.outbox.Cut's log line; the peer sees the connection reset)
NOT_TAKING = "not reading: a reply waited {s:g} s for its socket to take it"


class OpenSockets(AddressShares):
    """The gateway's agent sockets open now, in all and by peer address (the count: :class:`AddressShares`)."""

    def __init__(self, bounds: SocketBounds):
        super().__init__(bounds.sockets_per_peer, log, "agent socket (--agent-sockets-per-peer)")
        self.sockets = bounds.sockets

    def take(self, peer: str) -> str | None:
        """One more socket from ``peer`` -> None (counted; :meth:`leave` gives it back), else its named refusal."""
        if sum(self.held.values()) >= self.sockets:
            return TOO_MANY_SOCKETS.format(n=self.sockets)
        return None if self.enter(peer, quiet=True) else TOO_MANY_FROM_PEER.format(n=self.share)


class MessageRate:
    """A token bucket: ``take()`` is True for a message within ``per_second`` sustained, ``burst`` at once."""

    def __init__(self, per_second: float, burst: int):
        self.per_second, self.burst = per_second, burst
        self.tokens, self.refilled = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.refilled) * self.per_second)
        self.refilled = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
