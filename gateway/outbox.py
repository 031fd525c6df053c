"""What a connection owes its client: the one bound on unsent audio for every gateway surface (the speech
route, its SSE, the agent socket), and the one way a connection is cut.

Each surface reads its Triton streams as fast as the server makes them (a gRPC stream that is not read
stops tritonserver's writes to it, which then holds the unread responses and the request's slot) into the
connection's :class:`Outbox`, and one writer takes from it as the client's socket accepts. At most
``--max-unsent-seconds`` of audio (24 kHz samples, over all the connection's streams together: an agent
socket's contexts share one bound) may wait there; past it, :class:`Cut` ends the connection at once
(``transport.abort``: nothing waits on a peer that does not read) with one log line naming the peer and
why, and the surface cancels its streams (their slots are free at the generator's next step).

Pacing: every Triton stream a surface opens is paced (client.pace, serving.flow.pacing) by what its client
takes: the audio an item carries counts as delivered when the writer takes the item from the outbox, and
when the writer finds the outbox empty its client has taken all it was given. So the server keeps its
generator at most two of the stream's largest chunks ahead of the client, and a client that stops reading
has little more than that made for it, long before the unsent bound would cut it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from client.pace import Pace
from engine.protocol import SAMPLE_RATE

ABORT = "gateway.abort"  # scope["extensions"][ABORT]: cuts the connection now (gateway.server's protocols set it)
log = logging.getLogger("gateway")


class ClientNotReading(Exception):
    def __init__(self, waiting: int, limit: int):
        super().__init__(f"not reading: its client left {waiting / SAMPLE_RATE:.1f} s of audio untaken "
                         f"(the bound: {limit / SAMPLE_RATE:g} s)")  # fmt: skip


class Outbox:
    """A connection's replies in order, each with the samples of audio it carries (24 kHz) and the
    :class:`~client.pace.Pace` of the stream they came from, from :meth:`put` (never blocks) to :meth:`get`
    (the connection's one writer), which counts them delivered."""

    def __init__(self, unsent_seconds: float):
        self.limit = int(unsent_seconds * SAMPLE_RATE)
        self.items: asyncio.Queue = asyncio.Queue()
        self.waiting = 0  # samples put and not yet taken
        self.paces: set[Pace] = set()  # the paces of items taken since the outbox was last found empty

    def put(self, item, samples: int = 0, pace: Pace | None = None) -> None:
        """Queue ``item``; :class:`ClientNotReading` (nothing queued) if that would leave more than the
        bound waiting."""
        if self.waiting + samples > self.limit:
            raise ClientNotReading(self.waiting + samples, self.limit)
        self.waiting += samples
        self.items.put_nowait((item, samples, pace))

    async def get(self):
        if self.items.empty() and self.paces:  # the client took all it was given: it is caught up
            for pace in self.paces:
                pace.caught_up()
            self.paces.clear()
        item, samples, pace = await self.items.get()
        self.waiting -= samples
        if pace is not None and samples:
            pace.took(samples)
            self.paces.add(pace)
        return item

    def empty(self) -> bool:
        return self.items.empty()


class Cut:
    """Ends one connection now (``abort()``, the transport's; None where the server offers none) and logs
    once, one line naming ``peer`` and the reason; :attr:`done` is set. A connection closed politely for a
    reason (an idle socket) logs it with :meth:`closing`, and logs nothing more if it is then cut."""

    def __init__(self, abort: Callable[[], None] | None, peer: str, what: str = "a connection"):
        self.abort, self.peer, self.what = abort, peer, what
        self.reason: str | None = None
        self.aborted = False
        self.done = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self._log(reason, "cut")
        if self.abort is not None and not self.aborted:
            self.aborted = True
            self.abort()

    def closing(self, reason: str) -> None:
        self._log(reason, "closed")

    def _log(self, reason: str, how: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.warning("%s from %s %s: %s", self.what, self.peer, how, reason)
            self.done.set()


def peer_of(scope: dict | None) -> str:
    """``host:port`` of an ASGI scope's client ("unknown" without one)."""
    client = (scope or {}).get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"
