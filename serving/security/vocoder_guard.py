"""What the vocoder may do with a chunk, decided before any decoding (no Triton, no torch): only what the generator
made, once, in order, for streams its board lists. Why and the rules: docs/security.md ("the vocoder decodes only
what the generator made"), docs/architecture.md ("Sealing", "The live board")."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.protocol import CANCELLED, LENGTH, STOP, Chunk, Unavailable
from serving.flow.side_channel import GONE, UNCLAIMED_SECONDS

UNKNOWN = "unknown stream (chunks are made by the generator, each used once)"
# A chunk the generator sealed is genuine: a stream it belongs to that is gone here was dropped by the server
# (the generator gave it up, or this table reaped it), which is no fault of the client's.
DROPPED = "the server dropped this stream before its end (a generator or vocoder fault); retry"

# An ended stream that a key-less request opened is dropped once idle this long: tts_ensemble feeds the
# vocoder as the generator makes chunks, so its last chunk follows the generator's end within
# milliseconds; a stranger's late replay of a kept chunk 0 holds state no longer than this.
PUBLIC_ENDED_IDLE_SECONDS = 2.0

# A stream whose end came is remembered as finished this long (the generator's bound on a late consumer)
FINISHED_SECONDS = UNCLAIMED_SECONDS
MAX_FINISHED = 16384  # finished streams remembered (the oldest forgotten first)


@dataclass
class Decision:
    """What to do with one chunk."""

    decode: bool  # hand it to VocoderService (which opens, decodes, flushes or frees)
    reason: str = ""  # the FINISH_REASON to answer without decoding (decode False), or ""
    error: Exception | None = None  # answer with this failure instead (decode False)


class VocoderGuard:
    def __init__(self, keys, channel, max_streams: int):
        """``channel``: the run's :class:`serving.flow.side_channel.SideChannel` (its live board, its cancel marks)."""
        self.keys, self.channel, self.live_streams, self.max_streams = keys, channel, channel.live, max_streams
        self.next_seq: dict[int, int] = {}  # open stream -> the seq its next chunk must have
        self.opened: set[int] = set()  # ids whose stream was opened (single use), while the board lists them
        self.ours: set[int] = set()  # open streams that a request with the internal key opened (tts's)
        self.finished: OrderedDict[int, float] = OrderedDict()  # opened streams whose end came -> when

    def decide(self, chunk: Chunk, streams: dict, cancelled: bool = False, opening: int = 0,
               trusted: bool = False) -> Decision:  # fmt: skip
        """``streams``: the service's table (id -> stream with ``last_seen``), where evictions happen;
        ``opening``: streams that chunks decided earlier in the same batch will open; ``trusted``: the
        request carries the internal key (tts), so the stream is owed to an admitted request until its end."""
        sid = chunk.stream_id
        ends_only = chunk.last and chunk.finish_reason not in (STOP, LENGTH)
        if cancelled:  # the ensemble's client left: nothing to decode for anybody
            if sid in streams or (self.keys.sealed(chunk) and self.live_streams.state(sid) != GONE):
                self.channel.mark("cancel", sid)  # the generator ends the stream at its next step
            self.forget(sid, streams)
            self._end(sid)
            return Decision(False, CANCELLED)
        if ends_only:
            self._end(sid)
            return Decision(True)  # frees the state, decodes nothing
        # not the generator's, or its end came (every chunk of it was used, or will never be), or opened before
        if not self.keys.sealed(chunk) or sid in self.finished or (chunk.seq == 0 and sid in self.opened):
            return Decision(False, error=ValueError(UNKNOWN))
        if chunk.seq == 0:
            if self.live_streams.state(sid) == GONE:
                return Decision(False, error=Unavailable(DROPPED))
            if len(streams) + opening >= self.max_streams and not self._make_room(streams):
                return Decision(False, error=Unavailable(f"the vocoder holds its maximum of {self.max_streams} "
                                                         "generating streams; retry shortly"))  # fmt: skip
            self.opened.add(sid)
            if trusted:
                self.ours.add(sid)
        elif sid not in self.next_seq and sid not in streams:  # a later chunk of a stream this table let go
            return Decision(False, error=Unavailable(DROPPED))
        elif self.next_seq.get(sid) != chunk.seq or len(chunk.prompt_latents):
            return Decision(False, error=ValueError(UNKNOWN))
        if chunk.last:
            self._end(sid)
        else:
            self.next_seq[sid] = chunk.seq + 1
        return Decision(True)

    def _end(self, sid: int) -> None:
        """The stream's end reached the vocoder: no next chunk, off the board, finished here if opened here."""
        self.next_seq.pop(sid, None)
        self.live_streams.claim(sid)
        if sid in self.opened:
            self.finished[sid] = time.monotonic()
            self.finished.move_to_end(sid)
            while len(self.finished) > MAX_FINISHED:
                self.finished.popitem(last=False)

    def forget(self, sid: int, streams: dict) -> None:
        """Drop a stream's state (its id stays used until the generator forgets it)."""
        streams.pop(sid, None)
        self.next_seq.pop(sid, None)
        self.ours.discard(sid)

    def _make_room(self, streams: dict) -> bool:
        """Evict one stream off the board, else one of a key-less consumer that the generator has ended
        (tts_ensemble's, or a stranger's who kept chunks of ensemble_generator); False if every stream is
        generating or owed to tts."""
        live, ended = self.live_streams.snapshot()
        gone = [i for i in streams if i not in live and i not in ended]
        public = [i for i in streams if i in ended and i not in self.ours]
        for candidates in (gone, public):
            if candidates:
                self.forget(min(candidates, key=lambda i: streams[i].last_seen), streams)
                return True
        return False

    def reap(self, streams: dict, idle_seconds: float, now: float | None = None) -> list[int]:
        """Drop streams off the board (their consumer is gone), streams idle for ``idle_seconds`` and ended
        key-less ones idle for :data:`PUBLIC_ENDED_IDLE_SECONDS`; forget used ids off the board, and
        finished ones after :data:`FINISHED_SECONDS`. Returns the streams dropped."""
        now = time.monotonic() if now is None else now
        live, ended = self.live_streams.snapshot()
        held = live | ended
        dead = [i for i, s in streams.items() if i not in held or now - s.last_seen > idle_seconds
                or (i in ended and i not in self.ours and now - s.last_seen > PUBLIC_ENDED_IDLE_SECONDS)]  # fmt: skip
        for i in dead:
            self.forget(i, streams)
        self.opened &= held
        while self.finished and now - next(iter(self.finished.values())) > FINISHED_SECONDS:
            self.finished.popitem(last=False)
        self.next_seq = {i: n for i, n in self.next_seq.items() if i in streams}
        return dead
