"""Pacing (T22): ``tts``'s :class:`Pacer` per request, in a :class:`PaceTable` by token. No Triton here. Rules and
bounds: docs/architecture.md, "Pacing (``pace``)", and docs/serving.md, "Pacing: a client that does not read"."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import re
import time
from collections.abc import Callable

from engine.chunking import PATCH_SECONDS, ChunkSchedule
from engine.protocol import INVALID
from serving.contract import DELIVERED, PACE, PACE_REQUEST
from serving.flow.pace_board import FULL, POLL_SECONDS, UNKNOWN, PaceBoard

log = logging.getLogger("tts")
TOKEN = re.compile(r"[A-Za-z0-9_-]{16,64}")  # a token: unguessable, chosen by its client
MAX_UPDATES = 10_000  # pace requests one request may take
HOLD_ERROR = INVALID + "not reading: its client took no audio for {hold:g} s while the stream was paused " \
    "(--pace-hold-seconds); the stream was ended"  # fmt: skip
UNKNOWN_TOKEN = INVALID + PACE_REQUEST + "no running request has this pace token"
TOO_MANY = f"{INVALID}{PACE_REQUEST}a request takes at most {MAX_UPDATES} of them"
# The request a stream of the generator is made for: serving.stub.bls_adapters.BLSGenerator registers its
# streams with it (tts sets it in the request's context, as engine.lifetime.LINGERING).
PACING: contextvars.ContextVar[Pacer | None] = contextvars.ContextVar("pacing", default=None)


class Pacer:
    """One paced request: seconds sent and delivered, the generator streams it has open, whether they are
    paused. ``mark(id)``/``unmark(id)`` hold and release a stream (serving.flow.receipts.Receipts); times are
    seconds of one monotonic clock, given by the caller."""

    def __init__(self, lead: float, hold: float, mark: Callable[[int], None], unmark: Callable[[int], None],
                 now: float):  # fmt: skip
        if not lead > 0 or not hold > 0:
            raise ValueError(f"lead and hold must be > 0 seconds, got {lead}, {hold}")
        self.lead, self.hold, self.mark, self.unmark = lead, hold, mark, unmark
        self.sent = self.made = self.delivered = 0.0
        self.speed = 1.0  # the request's speaking rate: made seconds / speed are seconds of its audio
        self.updates = 0  # pace requests taken (read without a board: with one, the board counts them)
        self.streams: set[int] = set()
        self.paused = False
        self.pauses = 0  # pauses begun and ended so far (engine.start_window.CLIENT_PAUSES: not the server's lateness)
        self.progress = now  # when delivery last grew, or the pause began
        self.held_out = False  # expired: the request is ended with :attr:`failure`
        self.token = ""  # its token in the table (PaceTable.start)
        self.shared = None  # its delivery on the run's PaceBoard (tts's instances share it), if any

    def paced_by(self, schedule: ChunkSchedule, speed: float = 1.0) -> None:
        """The request's chunk schedule and speed are read. A paced request's lead, how far the generator may get
        ahead of the listener, is two of its largest chunks (``chunk_next`` patches each; 7.68 s at the default 24).
        A chunk is cut at most that large, so the listener then holds at least one whole chunk more than the
        deadline rule asks for while the next one is made."""
        if self.token:
            self.lead, self.speed = 2 * schedule.cap * PATCH_SECONDS, speed

    def held(self) -> bool:  # expired now
        return self.expired(time.monotonic())

    def open(self, stream_id: int) -> None:  # a generator stream of this request starts (held if it is paused)
        self.streams.add(stream_id)
        if self.paused:
            self.mark(stream_id)

    def close(self, stream_id: int) -> None:  # it ended: its hold, if any, is obsolete
        self.streams.discard(stream_id)
        if self.paused:
            self.unmark(stream_id)

    def on_sent(self, seconds: float, now: float) -> None:  # the request sent its client ``seconds`` in all
        self.sent = seconds
        self._decide(now)

    def on_made(self, seconds: float, now: float) -> None:
        """A chunk of ``seconds`` of speech (at the model's rate) came from the generator: counted at once, not
        when it is sent, so that a backlog between the generator and the client's sends cannot hide it."""
        self.made += seconds / self.speed
        self._decide(now)

    def took(self, seconds: float, now: float) -> None:
        """Its client's listener has taken ``seconds`` in all (a pace request, or the board's): only growth counts."""
        if seconds > self.delivered:
            self.delivered, self.progress = seconds, now
            self._decide(now)

    @property
    def ahead(self) -> float:  # seconds made (or sent) and not yet delivered
        return max(self.made, self.sent) - self.delivered

    def _decide(self, now: float) -> None:
        if not self.paused and self.ahead > self.lead:
            self.paused, self.progress = True, now
            self.pauses += 1
            for stream_id in self.streams:
                self.mark(stream_id)
        elif self.paused and (self.ahead < self.lead / 2 or 0 < self.sent <= self.delivered):
            # (the second: its client took all it was sent; what it waits for is made and not sent yet)
            self.end()

    def expired(self, now: float) -> bool:
        """Whether the request has been paused with no delivery for ``hold`` seconds (once true, it stays:
        :attr:`held_out`)."""
        if not self.held_out and self.paused and now - self.progress > self.hold:
            self.held_out = True
            log.warning("a paced request is ended: its client took no audio for %g s while it was paused", self.hold)
        return self.held_out

    @property
    def failure(self) -> str:
        return HOLD_ERROR.format(hold=self.hold)

    def end(self) -> None:  # resume (the request's end included: no hold outlives it)
        if self.paused:
            self.paused = False
            self.pauses += 1
            for stream_id in self.streams:
                self.unmark(stream_id)


class PaceTable:
    """The running paced requests by token; bounded by the running requests (one entry each). ``hold`` and
    ``mark``/``unmark``: every :class:`Pacer`'s (:meth:`start` makes them). ``board``: the run's, when tts has
    several instances (a pace request reaches any of them: serving.flow.pace_board); None: this table is all."""

    def __init__(self, hold: float, mark: Callable[[int], None], unmark: Callable[[int], None],
                 board: PaceBoard | None = None):  # fmt: skip
        self.pacers: dict[str, Pacer] = {}
        self.hold, self.mark, self.unmark, self.board = hold, mark, unmark, board
        self.poller: asyncio.Task | None = None  # (with a board) reads the board for every pacer here

    def start(self, parameters: dict, now: float) -> Pacer:
        """A request's pacer, in the table under its token; ValueError (named) for a bad token or one in use.
        A request without a token gets one that never pauses (its lead stays infinite: :meth:`Pacer.paced_by`)."""
        pacer = Pacer(math.inf, self.hold, self.mark, self.unmark, now)
        token = parameters.get(PACE)
        if token is not None:
            if not isinstance(token, str) or not TOKEN.fullmatch(token):
                raise ValueError(f"{INVALID}parameter {PACE} must be 16-64 characters of A-Z, a-z, 0-9, _ and -")
            if token in self.pacers or (self.board and (shared := self.board.open(token)) is None):
                raise ValueError(f"{INVALID}parameter {PACE}: this pace token is in use by a running request")
            self.pacers[token] = pacer
            pacer.token = token
            pacer.shared = shared if self.board else None
            if self.board and self.poller is None:  # (on the stub's event loop, which calls start)
                self.poller = asyncio.get_running_loop().create_task(self._poll())
        return pacer

    async def _poll(self) -> None:  # while paced requests run here
        while self.pacers:
            await asyncio.sleep(POLL_SECONDS)
            now = time.monotonic()
            for pacer in list(self.pacers.values()):
                pacer.took(PaceBoard.delivered(pacer.shared), now)
        self.poller = None

    def end(self, pacer: Pacer) -> None:  # the request is over: no hold outlives it, its token is free
        pacer.end()
        if self.pacers.get(pacer.token) is pacer:
            del self.pacers[pacer.token]
            if pacer.shared is not None:
                self.board.close(pacer.token, pacer.shared)

    def answer(self, parameters: dict, now: float) -> str | None:
        """A pace request -> the error of its answer (a bad ``delivered``, an unknown token, past
        :data:`MAX_UPDATES`), or None: taken."""
        token, value = parameters.get(PACE), parameters.get(DELIVERED)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            return f"{INVALID}{PACE_REQUEST}parameter {DELIVERED} must be a number of seconds >= 0"
        if not isinstance(token, str) or not TOKEN.fullmatch(token):
            return UNKNOWN_TOKEN
        pacer = self.pacers.get(token)
        if self.board is not None:  # counted on the board, whichever instance runs the request
            error = {UNKNOWN: UNKNOWN_TOKEN, FULL: TOO_MANY}.get(self.board.deliver(token, float(value), MAX_UPDATES))
        else:  # counted here: this table is all
            error = UNKNOWN_TOKEN if pacer is None else TOO_MANY if pacer.updates >= MAX_UPDATES else None
        if pacer is not None and error is None:
            pacer.updates += 1
            pacer.took(float(value), now)
        return error
