"""What every request in flight may hold together, not only each one: request bodies being read or kept
(uploads), and decoded audio (a reference or a recording to edit, float32). Past a total, a request is
answered at once with 503 and ``Retry-After`` (OpenAI's SDKs retry it), before it reads or decodes more.

Each request's share is given back when its answer is over (:class:`ReleaseHolds`, an ASGI middleware
around every route), whatever way it ends. Before these totals, 128 concurrent anonymous 19 MB edit uploads
took the gateway from 0.88 to 7.8 GB (the per-request limits held; their number did not).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import UNAVAILABLE_TYPE, APIError

HOLDS = "gateway.holds"  # the scope key of a request's list of (Budget, bytes) it holds


@dataclass(frozen=True)
class Bounds:
    """The gateway's totals over all requests in flight, the unsent audio a stream may have, and the Triton
    streams one client address may have open at once."""

    upload_bytes: int = 96 * 2**20  # request bodies read or being read (a reference upload is at most 20 MB)
    decoded_bytes: int = 192 * 2**20  # decoded uploads kept (a 60 s reference at 192 kHz decodes to 46 MB)
    # seconds of audio a connection's streams have made and its client has not taken (beyond what the
    # connection's socket buffers hold; an agent socket's contexts together): past it the streams are ended,
    # their generator slots freed and the connection cut (gateway.outbox)
    unsent_seconds: float = 30.0
    # Triton streams open at once from one address, every route together (gateway.shares): each may hold
    # one of the server's admission places (40 with 8 slots), so one address holds at most a fifth of them;
    # a voice agent speaks one or two turns at once, a small batch client a few requests
    streams_per_peer: int = 8

    def __post_init__(self) -> None:
        for name in ("upload_bytes", "decoded_bytes", "unsent_seconds", "streams_per_peer"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


DEFAULT_BOUNDS = Bounds()


class Budget:
    """A total in bytes that requests take from and give back (on the event loop: no lock)."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.held = total, what, 0

    def take(self, scope: dict, n: int) -> None:
        """Hold ``n`` more bytes for the request of ``scope`` until its answer is over; 503 (and the
        connection closed: the rest of its body is unwanted) if that would pass the total."""
        if self.held + n > self.total:
            raise APIError(503, f"server busy: {self.what} of the requests in flight would pass "
                                f"{self.total / 2**20:.1f} MB; retry shortly", kind=UNAVAILABLE_TYPE, close=True)  # fmt: skip
        self.held += n
        scope.setdefault(HOLDS, []).append((self, n))


class Budgets:
    """An app's totals (``app.state.budgets``), made from its :class:`Bounds`."""

    def __init__(self, bounds: Bounds):
        self.bounds = bounds
        self.uploads = Budget(bounds.upload_bytes, "the request bodies")
        self.decoded = Budget(bounds.decoded_bytes, "the decoded uploads")


class ReleaseHolds:
    """ASGI middleware: what a request took from a :class:`Budget` is given back once its answer is over
    (sent, failed or abandoned by the client)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[HOLDS] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for budget, n in scope.pop(HOLDS, []):
                budget.held -= n
