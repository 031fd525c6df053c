"""The agent socket's bounds (:mod:`gateway.agent_socket`) and the names of its refusals: each refusal's
error reply starts with its name, so a client (and docs/agents.md) can tell them apart."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from serving.contract import DEFAULT_TEXT_IDLE_SECONDS, MAX_STREAM_CHARS


@dataclass(frozen=True)
class SocketBounds:
    sockets: int = 64  # agent sockets open on the gateway at once
    contexts: int = 8  # contexts open at once on one socket
    context_chars: int = MAX_STREAM_CHARS  # text one context takes in all: a text-in stream's, the server's bound
    idle_seconds: float = 300.0  # a socket without a message for this long, and no context open, is closed
    # a context waiting for more text (continue true) this long fails: the server's default for a text-in stream
    context_idle_seconds: float = DEFAULT_TEXT_IDLE_SECONDS
    # per socket: Pipecat's TOKEN mode sends each LLM token as a message (fast LLMs stream 100-500 a second)
    messages_per_second: float = 200.0  # sustained
    message_burst: int = 1000  # at once

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


# Refusals, by name (the error reply's text starts with them)
TOO_MANY_SOCKETS = "too many sockets: the server has {n} agent sockets open; retry shortly"
TOO_MANY_CONTEXTS = "too many contexts: a socket has at most {n} open at once; end or cancel one first"
CONTEXT_TOO_LONG = "context text too long: a context takes at most {n} characters in all"
TOO_FAST = "too many messages: a socket takes at most {rate:g} a second (bursts of {burst})"
IDLE = "socket idle: no message for {s:g} s and no context open; closing"
CONTEXT_IDLE = "context idle: no text for {s:g} s and no continue false; it is cancelled"
BINARY = "binary frames are not read: send JSON text messages"
ENDED = "context ended: it was sent continue false; send more text under a new context_id"
TRY_AGAIN_LATER = 1013  # the WebSocket close code for "try again later"


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
