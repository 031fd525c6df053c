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
from collections.abc import AsyncIterator, Callable, Iterator

from gateway.errors import RETRY_AFTER_SECONDS, APIError, log
from gateway.text_streams import TextStream, TextStreams
from serving.fronts.front_limits import AddressShares

TOO_MANY_STREAMS = "too many streams from your address: at most {n} at once"
RATE_LIMIT_TYPE = "rate_limit_error"  # OpenAI's type for a 429 (its SDKs retry it, after Retry-After)


class Share:
    """One stream's hold on its address's share; :meth:`give_back` is idempotent (every end path may call it)."""

    def __init__(self, owner: StreamShares, peer: str):
        self.owner, self.peer, self.held = owner, peer, True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.owner.leave(self.peer)


class StreamShares(AddressShares):
    """Triton streams open now, by peer address (the client's IP as the gateway's connection sees it), at
    most ``per_peer`` each (the count and its log line: :class:`serving.fronts.front_limits.AddressShares`)."""

    def __init__(self, per_peer: int):
        if not per_peer > 0:
            raise ValueError(f"streams_per_peer must be > 0, got {per_peer}")
        super().__init__(per_peer, log, "Triton stream (--streams-per-peer)")

    def take(self, peer: str) -> Share:
        """One more stream for ``peer`` -> its :class:`Share`; over the share, an :class:`APIError` 429 (with
        ``Retry-After``) naming the bound, and one log line (at most every 10 s per address)."""
        if not self.enter(peer):
            raise APIError(429, TOO_MANY_STREAMS.format(n=self.share), kind=RATE_LIMIT_TYPE,
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})  # fmt: skip
        return Share(self, peer)

    def try_take(self, peer: str) -> Share | None:
        """One more stream for ``peer`` if its share has room, else None (a caller that waits for room, as a
        job's part does: no refusal, no log line)."""
        return Share(self, peer) if self.enter(peer, quiet=True) else None

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[Share]:
        """A share held for the ``with`` block (a call that opens one stream and waits for its end)."""
        share = self.take(peer)
        try:
            yield share
        finally:
            share.give_back()


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
