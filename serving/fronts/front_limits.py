"""The fronts' bounds, written once: :class:`FrontLimits` (gRPC) and :class:`HttpFrontLimits` (HTTP), one
launcher flag per field (``--grpc-front-max-message-mb`` for ``FrontLimits.max_message_mb``), and when the
launcher puts a front in place (``--grpc-front``, ``--http-front``: ``auto|on|off``); and
:class:`AddressShares`, each client address's share, held by the gRPC front and the gateway."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

LOG_EVERY = 10.0  # seconds between two log lines about one address's refusals
LOGGED_ADDRESSES = 1024  # addresses whose last log line is remembered (the oldest are forgotten first)
RULES = {">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0, ">= 1": lambda v: v >= 1}  # NaN passes none


def default_max_message_mb() -> float:
    """The largest legitimate request, with room for its other inputs: the longest reference
    (MAX_REFERENCE_SECONDS) at the highest rate taken, as float32 samples, plus 1 MiB: 44.9 MiB."""
    from engine.audio import REFERENCE_RATES
    from engine.protocol import MAX_REFERENCE_SECONDS

    return math.ceil((MAX_REFERENCE_SECONDS * REFERENCE_RATES[1] * 4 + 2**20) / 2**20 * 10) / 10


def bound(default, rule: str, help: str):
    """A field of a front's bounds: its default, what a value must be (a key of RULES), its flag's help."""
    return field(default=default, metadata={"rule": rule, "help": help})


class _Bounds:
    """What the two fronts' bounds share: each field checked against its rule, the unsent bound in bytes,
    and one launcher flag per field, ``--{FLAG}-{name}`` (:func:`add_arguments`)."""

    FLAG: ClassVar[str]  # the flags' prefix: grpc-front, http-front
    MODE_HELP: ClassVar[str]  # the help of --{FLAG} itself (auto|on|off)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not RULES[f.metadata["rule"]](value := getattr(self, f.name)):
                raise ValueError(f"{f.name} must be {f.metadata['rule']}, got {value}")

    @property
    def unsent_bytes(self) -> int:
        return int(self.max_unsent_mb * 2**20)

    @classmethod
    def from_flags(cls, args: argparse.Namespace):
        """Parsed flags -> the bounds (ValueError if one is out of range)."""
        return cls(**{f.name: getattr(args, f"{cls.FLAG}_{f.name}".replace("-", "_")) for f in fields(cls)})


@dataclass(frozen=True)
class FrontLimits(_Bounds):
    FLAG: ClassVar[str] = "grpc-front"
    MODE_HELP: ClassVar[str] = ("the bounded gRPC front on --grpc-port, with Triton's own gRPC on a private loopback port "
                                "(serving.fronts.grpc_front); auto: on when Triton's gRPC would otherwise be reachable "
                                "from other machines (a non-loopback --triton-host, or --host without it)")  # fmt: skip
    max_message_mb: float = bound(0.0, ">= 0", "largest request message in MiB; larger: RESOURCE_EXHAUSTED before "
                                  "Triton sees it (default 0: the longest reference at the highest rate, 44.9 MiB)")  # fmt: skip
    max_calls: int = bound(0, ">= 0", "calls in progress at once, all connections together; more: RESOURCE_EXHAUSTED "
                           "(default 0: 2 x (slots + queue) + 32)")  # fmt: skip
    max_calls_per_client: int = bound(0, ">= 0", "calls in progress at once from one client address (all its "
                                      "connections); more: RESOURCE_EXHAUSTED naming this flag (default 0: a quarter "
                                      "of max-calls)")  # fmt: skip
    call_idle_seconds: float = bound(120.0, "> 0", "a stream call that holds nothing this long (every request "
                                     "answered, no response from Triton or waiting for its client; a text-in stream "
                                     "between pieces meets the server's --text-idle-seconds first) is ended")  # fmt: skip
    max_connections: int = bound(512, ">= 1", "open connections; more are closed at once")
    max_streams_per_connection: int = bound(64, ">= 1", "HTTP/2 streams (calls) one connection may have open; the "
                                            "client holds its further calls back until one ends")  # fmt: skip
    idle_seconds: float = bound(300.0, ">= 0", "a connection with no call for this long is closed (clients reconnect)")
    handshake_seconds: float = bound(10.0, ">= 0", "a connection that has not finished its HTTP/2 handshake by "
                                     "then is closed")  # fmt: skip
    keepalive_seconds: float = bound(60.0, ">= 0", "the front pings each connection that has a call in progress "
                                     "this often (one without a call meets idle-seconds)")  # fmt: skip
    keepalive_timeout_seconds: float = bound(20.0, "> 0", "a ping (keepalive or gRPC's own) not answered in this "
                                             "long closes the connection and ends its calls")  # fmt: skip
    max_unsent_mb: float = bound(8.0, "> 0", "responses of one stream its client has not taken, in MiB (8 MiB: 87 s "
                                 "of 24 kHz float32 audio); past it the stream is ended, its slot freed")  # fmt: skip
    max_unsent_seconds: float = bound(20.0, "> 0", "how long a stream's client may take nothing while responses "
                                      "wait for it; then the stream is ended, its slot freed")  # fmt: skip

    def for_places(self, places: int, text_idle_seconds: float = 0.0) -> FrontLimits:
        """``max_calls`` 0 resolved for ``places`` admission places (slots + queue): a call per stream, as many
        again refused as busy, and 32 for health and metadata. ValueError if ``call_idle_seconds`` is not above
        ``text_idle_seconds`` (a text-in stream between pieces is for the server's bound to end, with an answer)."""
        if self.call_idle_seconds <= text_idle_seconds:
            raise ValueError(f"--grpc-front-call-idle-seconds ({self.call_idle_seconds:g}) must be above "
                             f"--text-idle-seconds ({text_idle_seconds:g})")  # fmt: skip
        return self if self.max_calls else replace(self, max_calls=2 * places + 32)

    @property
    def calls_per_client(self) -> int:
        """``max_calls_per_client`` resolved: 0 (no share) only where ``max_calls`` is unbounded too."""
        if self.max_calls_per_client or not self.max_calls:
            return self.max_calls_per_client
        return max(1, self.max_calls // 4)

    @property
    def message_bytes(self) -> int:
        return int((self.max_message_mb or default_max_message_mb()) * 2**20)

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server options for these bounds (``max_calls`` goes to the server itself)."""
        ms = lambda seconds: max(1, int(seconds * 1000))  # noqa: E731
        return [
            ("grpc.max_receive_message_length", self.message_bytes),
            ("grpc.max_send_message_length", -1),  # what Triton answers is bounded by the contract
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", ms(self.idle_seconds)),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_seconds)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_seconds)),
            # gRPC 1.85 closes a connection whose ping goes unanswered after ping_timeout_ms (default 60 s),
            # whatever keepalive_timeout_ms says (measured): both get the bound
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_seconds)),
            ("grpc.http2.ping_timeout_ms", ms(self.keepalive_timeout_seconds)),
            ("grpc.max_metadata_size", 16 * 1024),
            ("grpc.so_reuseport", 0),  # a second server on the port is an error, not a silent share
        ]


@dataclass(frozen=True)
class HttpFrontLimits(_Bounds):
    FLAG: ClassVar[str] = "http-front"
    MODE_HELP: ClassVar[str] = ("the bounded HTTP front on --http-port, with Triton's own HTTP on a private loopback "
                                "port (serving.fronts.http_front); auto: as --grpc-front")  # fmt: skip
    max_body_mb: float = bound(0.0, ">= 0", "largest request body in MiB (Content-Length, or a chunked body as it "
                               "streams); larger: 413 before Triton sees it (default 0: as --grpc-front-max-message-mb, "
                               "the longest reference at the highest rate as binary float32)")  # fmt: skip
    max_header_kb: float = bound(16.0, "> 0", "largest request head (request line and headers) in KiB; larger: 431")
    header_seconds: float = bound(10.0, "> 0", "a request head not complete this long after its connection opened "
                                  "(or after its first byte on a kept-alive connection) closes the connection")  # fmt: skip
    idle_seconds: float = bound(60.0, "> 0", "a kept-alive connection with no request for this long is closed, as "
                                "is one whose request body stops coming for as long")  # fmt: skip
    max_connections: int = bound(512, ">= 1", "open connections; more get 503 and are closed")
    max_unsent_mb: float = bound(8.0, "> 0", "a response its client has not taken, in MiB; past it the connection "
                                 "is closed, and Triton's request with it")  # fmt: skip
    max_unsent_seconds: float = bound(20.0, "> 0", "how long a client may take nothing while its response waits; "
                                      "then the connection is closed, and Triton's request with it")  # fmt: skip

    @property
    def body_bytes(self) -> int:
        return int((self.max_body_mb or default_max_message_mb()) * 2**20)

    @property
    def header_bytes(self) -> int:
        return int(self.max_header_kb * 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for cls in (FrontLimits, HttpFrontLimits):
        parser.add_argument(f"--{cls.FLAG}", choices=("auto", "on", "off"), default="auto", help=cls.MODE_HELP)
        for f in fields(cls):
            help = f.metadata["help"] + ("" if "default" in f.metadata["help"] else f" (default: {f.default:g})")
            metavar = {"mb": "MB", "kb": "KB", "seconds": "SECONDS"}.get(f.name.rpartition("_")[2], "N")
            parser.add_argument(f"--{cls.FLAG}-" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                                metavar=metavar, help=help)  # fmt: skip


def front_wanted(mode: str, triton_reachable_from_outside: bool) -> bool:
    return mode == "on" or (mode == "auto" and triton_reachable_from_outside)


class AddressShares:
    """What each client address has in progress, at most ``share`` each (0: no bound): the gRPC front's calls
    (so that one client cannot take the ``max_calls`` every client needs; gRPC's ``maximum_concurrent_rpcs``
    counts all clients as one) and the gateway's Triton streams (``gateway.shares``). One event loop uses it."""

    def __init__(self, share: int, log: logging.Logger, what: str):
        self.share, self.log, self.what = share, log, what  # what: the thing counted and its flag, for the log
        self.held: Counter[str] = Counter()  # an address with none is not kept
        self.logged: OrderedDict[str, float] = OrderedDict()  # address -> when its refusal was last logged

    def enter(self, address: str, quiet: bool = False) -> bool:
        """One more for ``address`` -> True; past its share, False and (unless ``quiet``) a log line, at most
        every LOG_EVERY s per address."""
        if not self.share or self.held[address] < self.share:
            self.held[address] += 1
            return True
        now = time.monotonic()
        if not quiet and now - self.logged.get(address, -LOG_EVERY) >= LOG_EVERY:
            self.logged[address] = now
            self.logged.move_to_end(address)
            while len(self.logged) > LOGGED_ADDRESSES:
                self.logged.popitem(last=False)
            self.log.warning("refused a %s from %s: it has %d in progress, at most %d per address (said at most "
                             "every %g s per address); in progress by address: %s", self.what, address,
                             self.held[address], self.share, LOG_EVERY,
                             ", ".join(f"{a} {n}" for a, n in self.held.most_common(5)))  # fmt: skip
        return False

    def leave(self, address: str) -> None:
        self.held[address] -= 1
        if self.held[address] <= 0:
            del self.held[address]
