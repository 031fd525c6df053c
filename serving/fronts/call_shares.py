"""Each client address's share of the gRPC front's calls: one client (all its connections together) may have
at most ``FrontLimits.calls_per_client`` calls in progress, so that it cannot take the ``max_calls`` every
client needs (gRPC's own ``maximum_concurrent_rpcs`` counts all clients as one). One event loop uses it."""

from __future__ import annotations

import collections
import logging

from engine.protocol import UNAVAILABLE

REFUSED_COUNTER = "tts_grpc_front_calls_refused_total"  # calls refused by the per-client share
LOG_EVERY = 10.0  # seconds between two log lines about one client's refused calls
_log = logging.getLogger("grpc_front")


def client_address(peer: str) -> str:
    """gRPC's peer (``ipv4:10.0.0.7:51234``, ``ipv6:[::1]:51234``, ``unix:/path``) -> the client's address,
    without its port (one client may open many connections)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


class CallShares:
    """Calls in progress by client address; ``enter`` refuses one past the share (0: no share)."""

    def __init__(self, share: int):
        self.share = share
        self.calls: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # since the client's last log line
        self.logged: dict[str, float] = {}  # monotonic time of each client's last log line

    def enter(self, address: str, now: float) -> str | None:
        """Count a call from ``address`` -> None, or the message to refuse it with (not counted)."""
        if self.share and self.calls[address] >= self.share:
            self.refused[address] += 1
            if now - self.logged.get(address, -LOG_EVERY) >= LOG_EVERY:
                _log.warning("refused %d gRPC call(s) from %s: it has %d calls in progress, its share "
                             "(--grpc-front-max-calls-per-client %d); %d calls from %d clients in all",
                             self.refused.pop(address), address, self.calls[address], self.share,
                             self.calls.total(), len(self.calls))  # fmt: skip
                self.logged[address] = now
            return (f"{UNAVAILABLE}this client ({address}) has {self.calls[address]} calls in progress, its share "
                    f"of the server's (--grpc-front-max-calls-per-client {self.share}); end one first")  # fmt: skip
        self.calls[address] += 1
        return None

    def leave(self, address: str) -> None:
        self.calls[address] -= 1
        if not self.calls[address]:
            del self.calls[address]
            self.logged.pop(address, None)
            self.refused.pop(address, None)
