"""One client's share of the server's admission places: the Triton streams the gateway opens for one peer
address at once (an agent socket's context, an HTTP speech, bytes, SSE or ElevenLabs stream, an edit, a
voice design, a long-text job's part), whatever the route. Each such stream may hold one of the server's admission places (slots +
``max_queue``: 40 with 8 slots) while it has text to speak; without a share, one address could hold them
all (16 sockets x 8 contexts, plus any number of HTTP streams) and everyone else got ``server busy``.

:class:`StreamShares` (``app.state.shares``, and the agent sockets') is the one owner: every place that
opens a Triton stream asks it first (:meth:`~StreamShares.take`: a :class:`Share`, or a 429 naming the
bound) and the share is given back when the stream ends, whatever way (done, failed, cancelled, client
gone): :func:`held` for an HTTP route's stream (an async generator's ``finally``), :func:`held_text` for an
agent socket's text stream (its iteration's end, or its cancel), :meth:`~StreamShares.hold` around a call.

The share is per address, not per key: the gateway checks no API keys (any key is taken), so a client could
name a new key for each stream. Behind a proxy every client has the proxy's address (as for the sockets).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator

from gateway.errors import RETRY_AFTER_SECONDS, APIError, log
from gateway.text_streams import TextStream, TextStreams

TOO_MANY_STREAMS = "too many streams from your address: at most {n} at once"
RATE_LIMIT_TYPE = "rate_limit_error"  # OpenAI's type for a 429 (its SDKs retry it, after Retry-After)
LOG_EVERY_SECONDS = 10.0  # one log line per refused address at most this often
LOGGED_PEERS = 1024  # addresses whose last log line is remembered (the oldest are forgotten first)


class Share:
    """One stream's hold on its address's share; :meth:`give_back` is idempotent (every end path may call it)."""

    def __init__(self, owner: StreamShares, peer: str):
        self.owner, self.peer, self.held = owner, peer, True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.owner._give_back(self.peer)


class StreamShares:
    """Triton streams open now, by peer address (the client's IP as the gateway's connection sees it), at
    most ``per_peer`` each. On the event loop: no lock."""

    def __init__(self, per_peer: int):
        if not per_peer > 0:
            raise ValueError(f"streams_per_peer must be > 0, got {per_peer}")
        self.per_peer = per_peer
        self.by_peer: Counter[str] = Counter()  # streams open now; an address with none is not kept
        self.logged: OrderedDict[str, float] = OrderedDict()  # address -> when its refusal was last logged

    def take(self, peer: str) -> Share:
        """One more stream for ``peer`` -> its :class:`Share`; over the share, an :class:`APIError` 429 (with
        ``Retry-After``) naming the bound, and one log line (at most every 10 s per address)."""
        if self.by_peer[peer] >= self.per_peer:
            self._log_refusal(peer)
            raise APIError(429, TOO_MANY_STREAMS.format(n=self.per_peer), kind=RATE_LIMIT_TYPE,
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})  # fmt: skip
        self.by_peer[peer] += 1
        return Share(self, peer)

    def try_take(self, peer: str) -> Share | None:
        """One more stream for ``peer`` if its share has room, else None (a caller that waits for room, as a
        job's part does: no refusal, no log line)."""
        if self.by_peer[peer] >= self.per_peer:
            return None
        self.by_peer[peer] += 1
        return Share(self, peer)

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[Share]:
        """A share held for the ``with`` block (a call that opens one stream and waits for its end)."""
        share = self.take(peer)
        try:
            yield share
        finally:
            share.give_back()

    def holdings(self) -> dict[str, int]:
        """Streams open now by address, most first (what an operator reads)."""
        return dict(self.by_peer.most_common())

    def _give_back(self, peer: str) -> None:
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]

    def _log_refusal(self, peer: str) -> None:
        now = time.monotonic()
        if now - self.logged.get(peer, -LOG_EVERY_SECONDS) < LOG_EVERY_SECONDS:
            return
        self.logged[peer] = now
        self.logged.move_to_end(peer)
        while len(self.logged) > LOGGED_PEERS:
            self.logged.popitem(last=False)
        top = ", ".join(f"{p} {n}" for p, n in list(self.holdings().items())[:5])
        log.warning("a stream from %s refused: it has %d open, at most %d per address (said at most every %g s "
                    "per address); streams open by address: %s", peer, self.by_peer[peer], self.per_peer,
                    LOG_EVERY_SECONDS, top)  # fmt: skip


def held(open_stream: Callable, shares: StreamShares, peer: str) -> Callable:
    """``open_stream`` (``AsyncTTSClient.stream`` or ``.edit``: an async generator) whose stream takes
    ``peer``'s share before it opens (at its first ``anext``: the refusal is raised there) and gives it back
    when it ends: exhausted, failed, or closed (the client went away)."""

    async def stream(**kw):
        share = shares.take(peer)
        try:
            async with contextlib.aclosing(open_stream(**kw)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            share.give_back()

    return stream


def held_text(open_text: TextStreams, shares: StreamShares, peer: str) -> TextStreams:
    """``open_text`` (an agent socket's) whose text streams each hold ``peer``'s share while open: taken
    before the stream opens (the refusal is raised), given back when its iteration ends (done or failed) or
    it is cancelled (barge-in, the socket's close)."""

    async def open_held(**fields) -> TextStream:
        share = shares.take(peer)
        try:
            return HeldText(await open_text(**fields), share)
        except BaseException:
            share.give_back()
            raise

    return open_held


class HeldText:
    """A :class:`gateway.text_streams.TextStream` that gives its share back when it ends."""

    def __init__(self, stream: TextStream, share: Share):
        self.stream, self.share = stream, share

    async def send(self, text: str, flush: bool = False) -> None:
        await self.stream.send(text, flush=flush)

    async def end(self) -> None:
        await self.stream.end()

    async def cancel(self) -> None:
        try:
            await self.stream.cancel()
        finally:
            self.share.give_back()

    def __aiter__(self) -> AsyncIterator:
        return self._items()

    async def _items(self) -> AsyncIterator:
        try:
            async for item in self.stream:
                yield item
        finally:
            self.share.give_back()


def host_of(scope: dict | None) -> str:
    """An ASGI scope's client address (no port: the share is the address's)."""
    client = (scope or {}).get("client")
    return client[0] if client else "unknown"
