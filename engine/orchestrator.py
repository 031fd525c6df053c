"""One utterance from text to audio, written once against three small async interfaces.

:class:`Orchestrator` runs the text front end (:func:`engine.frontend.prepare`: cleaning, language detection,
sentence grouping, normalization), encodes the voice prompt, runs each text segment as one generator
stream whose chunks go through the vocoder, cross-fades the segments, plays the result at the requested
speed (:mod:`engine.time_stretch`, as it streams), and reports why the utterance ended. It owns
cancellation and cleanup: however the caller stops (closing the iterator, task cancellation, an error
anywhere), every generator stream it opened is closed and every vocoder stream it started is ended
(the cleanup lingers past a cancelled caller: :mod:`engine.lifetime`).

Two implementations of the interfaces exist: in-process (:mod:`engine.local`, offline synthesis) and
BLS calls to the Triton models (``serving.stub.bls_adapters``, the ``tts`` model). The ``tts_ensemble`` entry point
speaks the same generator -> vocoder protocol (:class:`engine.protocol.Chunk`) without this class. No torch, no Triton.
Past 300 lines on purpose: one utterance's flow (segments, streams, cross-fades, speed, cleanup) is one class
read top to bottom, beside the small interfaces it is written against.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.chunking import ChunkSchedule
from engine.frontend import Prepared, prepare
from engine.frontend.text_in import TextInSegmenter
from engine.instructions import DESIGN, EDITS
from engine.lifetime import linger
from engine.params import DEFAULT_SCHEDULE, DEFAULT_SPLIT_TOKENS, READ_AHEAD, SPEED, GenerationParams
from engine.protocol import CANCELLED, ERROR, LENGTH, SAMPLE_RATE, STOP, Chunk, StreamFailed, end_chunk, new_stream_id
from engine.segments import Joiner, ahead_may_start, ahead_to_yield, segment_schedule
from engine.start_window import StartWindow
from engine.time_stretch import TimeStretch


@dataclass(frozen=True)
class Utterance:
    """What to say and how (the voice is passed separately, in whatever form the prompt encoder takes).

    Built where a request enters (``serving.intake.requests.parse_request``, :func:`engine.synthesize.instruct_run`)
    from checked values; the orchestrator takes it as it is."""

    text: str
    language: str | None = None  # None or "auto": detected from the text
    params: GenerationParams = GenerationParams()
    schedule: ChunkSchedule = DEFAULT_SCHEDULE  # how the chunks are sized (engine.chunking)
    split_tokens: int = DEFAULT_SPLIT_TOKENS  # 0: one segment
    normalize: bool = True  # wetext text normalization (cleaning and splitting run regardless)
    speed: float = SPEED.default  # speaking rate (engine.time_stretch); 1.0: the audio as made
    task: str = ""  # "": Base; else an Instruct task (engine.instructions.TASK_DEFAULTS' keys)
    instruction: str = ""  # Instruct: the checked, stripped instruction (engine.instructions.task_instruction)
    read_ahead: int = READ_AHEAD.default  # segments generating at once (capped by the orchestrator)


@dataclass(frozen=True)
class Segment:
    """One generator stream: a piece of the text with the utterance's prompt and settings."""

    stream_id: int
    text: str
    language: str
    prompt: Any  # what the PromptEncoder returned
    params: GenerationParams
    schedule: ChunkSchedule  # a later segment's carries what the listener holds as it starts
    task: str = ""  # "": a Base stream; else the Instruct task
    instruction: str = ""  # Instruct: the description or edit instruction (the same for every segment)
    ahead: bool = False  # a read-ahead segment: it takes a slot only if one is free and no start waits (Yielded)


@dataclass(frozen=True)
class Piece:
    """Audio ready to send. The last piece of an utterance has ``final`` and the finish reason.

    An Instruct utterance that writes text first (design, semantic edit) yields one piece with that
    ``text`` and no audio before its first audio (design: the first segment's plan, as the reference
    returns it)."""

    audio: np.ndarray  # (n,) float32 at 24 kHz, n may be 0
    final: bool = False
    finish_reason: str = ""
    text: str | None = None  # the plan text (maybe ""), on its own piece; None: not the plan
    flushed: int = 0  # a text stream's n-th flush is spoken (see Orchestrator.run_text), on its own piece


@dataclass(frozen=True)
class TextPiece:
    """A piece of a text-in utterance's text, as it arrives (:meth:`Orchestrator.run_text`)."""

    text: str
    flush: bool = False  # cut a segment after this piece (the flushes are counted from 1)


@dataclass(frozen=True)
class Cut:
    """A segment's text as the front end cut it, in its language."""

    text: str
    language: str
    last: bool = False  # the utterance's last segment (a text stream knows its last only at its end)


async def _ready(value):
    return value


class PromptEncoder(Protocol):
    async def encode(self, voice: Any) -> Any:
        """A voice (reference clip, voice id, ...) -> a prompt the generator understands."""


class GeneratorStreams(Protocol):
    def stream(self, segment: Segment) -> AsyncIterator[Chunk]:
        """The segment's chunks, ending with one whose ``last`` is set. Closing the iterator before
        that cancels the stream and frees its slot. A segment with ``ahead`` raises :class:`Yielded`
        before its first chunk instead of waiting when it cannot have a slot at once."""


class ReadAheadSlots(Protocol):
    """The generator slots' owner, for read-ahead (an orchestrator without one runs no segment ahead)."""

    def free_slots(self) -> int:
        """Generator slots nobody holds now."""

    def starts_waiting(self) -> int:
        """Streams that are not read-ahead segments waiting for a slot now."""


class Yielded(Exception):
    """A read-ahead segment could not have a generator slot (another stream came first): run it later."""


class Vocoder(Protocol):
    async def decode(self, chunk: Chunk) -> np.ndarray:
        """One chunk -> (n,) float32 samples finished by it (the rest of the stream with ``last``)."""


PREPARED_KEPT = 512  # texts whose front-end result an orchestrator keeps (the least recently used goes)
READ_AHEAD_SECONDS = 60.0  # default bound on a request's read-ahead audio waiting to be sent
AHEAD_POLL_SECONDS = 0.02  # how often an utterance with read-ahead looks at the generator's slots


class Orchestrator:
    def __init__(
        self,
        prompts: PromptEncoder,
        generator: GeneratorStreams,
        vocoder: Vocoder,
        count_tokens: Callable[[str], int],
        stream_ids: Callable[[], int] = new_stream_id,
        clock: Callable[[], float] = time.monotonic,
        starts: StartWindow | None = None,
        slots: ReadAheadSlots | None = None,
        read_ahead_cap: int = READ_AHEAD.high,
        read_ahead_seconds: float = READ_AHEAD_SECONDS,
    ):
        """``clock``: seconds of a monotonic clock, for what the listener holds as a later segment starts;
        ``starts``: the start window (None: none; see :meth:`_spoken`); ``slots``: the generator slots' owner
        (None: no read-ahead);
        ``read_ahead_cap``: the most segments of one utterance generating at once, whatever it asks
        (1: none ahead); ``read_ahead_seconds``: no further segment starts ahead while an utterance holds
        this much audio of segments run ahead and not yet sent (see :class:`_ReadAhead`)."""
        if not 1 <= read_ahead_cap <= READ_AHEAD.high:
            raise ValueError(f"read_ahead_cap must be in 1..{READ_AHEAD.high}, got {read_ahead_cap}")
        if not read_ahead_seconds > 0:
            raise ValueError(f"read_ahead_seconds must be > 0, got {read_ahead_seconds}")
        self.read_ahead_cap, self.read_ahead_seconds = read_ahead_cap, read_ahead_seconds
        self.prompts, self.generator, self.vocoder = prompts, generator, vocoder
        self.starts, self.slots = starts, slots  # starts: first come, first served
        self.count_tokens, self.stream_ids, self.clock = count_tokens, stream_ids, clock
        # the front end's results for recent texts: prepare() is a pure function of its arguments here
        # (count_tokens is this orchestrator's), ~2 ms of CPU per short text; a failure is not kept
        self.prepared: dict[tuple, Prepared] = {}

    def run(self, utterance: Utterance, voice: Any = None) -> AsyncIterator[Piece]:
        """Yield the utterance's audio as it is made, at ``utterance.speed``; the last piece is ``final``.

        Raises ValueError when nothing is left to speak after the front end, :class:`StreamFailed` when
        a generator stream fails, or whatever an interface raised; in every case the streams opened so
        far are closed before the exception leaves.
        """
        pieces = self._pieces(utterance, voice)
        return pieces if utterance.speed == 1.0 else stretched(pieces, utterance.speed)

    async def _pieces(self, utterance: Utterance, voice: Any) -> AsyncIterator[Piece]:
        """The utterance's pieces at the speed the model speaks."""
        u = utterance
        if u.task in EDITS:  # the whole recording is edited: no text, one stream
            texts, language = [""], ""
        else:
            # Before the prompt, so that unspeakable text fails fast; on a thread: wetext takes a while on
            # long texts, and the event loop serves every other request meanwhile.
            key = (u.text, u.language, u.split_tokens, u.normalize, u.params.max_patches)
            prepared = self.prepared.pop(key, None)
            if prepared is None:
                prepared = await asyncio.to_thread(
                    prepare, u.text, u.language, self.count_tokens, u.split_tokens, u.normalize, u.params.max_patches
                )
            self.prepared[key] = prepared  # the most recent last
            while len(self.prepared) > PREPARED_KEPT:
                del self.prepared[next(iter(self.prepared))]
            texts, language = prepared.segments, prepared.language
        prompt = None if u.task == DESIGN else await self.prompts.encode(voice)

        async def cuts():
            for i, text in enumerate(texts):
                yield Cut(text, language, last=i == len(texts) - 1)

        k = min(u.read_ahead, self.read_ahead_cap)
        ahead = k > 1 and len(texts) > 1 and self.slots is not None
        later = [Cut(text, language, last=i == len(texts) - 1) for i, text in enumerate(texts)]
        spoken = self._spoken(u, _ready(prompt), cuts(), k if ahead else 1, later)
        async with contextlib.aclosing(spoken) as pieces:
            async for piece in pieces:
                yield piece

    def run_text(
        self,
        utterance: Utterance,
        voice: Any,
        pieces: AsyncIterator[TextPiece],
        release: str = "flush",
        idle: Callable[[], None] | None = None,
    ) -> AsyncIterator[Piece]:
        """A text-in utterance: its text arrives as ``pieces`` (the stream's end is the end of the text;
        ``utterance.text`` is not read), cut into segments by :class:`engine.frontend.text_in.TextInSegmenter`
        (``release``: ``"flush"`` or ``"sentence"``) with the utterance's front-end settings. Each segment
        starts generating as soon as it is cut and the one before it has been generated, while later text
        still arrives. After all audio of the text up to the n-th flush, a piece with ``flushed`` n (no
        audio) follows; the last 50 ms of that audio come with the next segment, cross-faded into it, or
        with the final piece. The audio equals :meth:`run`'s for a text that the front end cuts into the same
        segments (same seed, voice and cross-fade), with a fixed chunk schedule (the deadline rule sizes
        chunks by the clock). Raises as :meth:`run`, and whatever ``pieces`` raises (closing everything).

        ``idle`` is called each time everything read from ``pieces`` so far has been spoken: no segment is
        generating (its generator stream is closed) or cut and waiting, and the segmenter holds no text but
        whitespace; checked after each piece and each segment (a caller holding a resource for the text,
        an admission place, gives it back; it may be called again while idle)."""
        out = self._text_pieces(utterance, voice, pieces, release, idle)
        return out if utterance.speed == 1.0 else stretched(out, utterance.speed)

    async def _text_pieces(self, utterance, voice, pieces: AsyncIterator[TextPiece], release: str, idle):
        u = utterance
        if u.task in EDITS:
            raise ValueError(f"TASK {u.task} edits a recording and takes no text stream")
        segmenter = TextInSegmenter(u.language, self.count_tokens, u.split_tokens, u.normalize,
                                    u.params.max_patches, release)  # fmt: skip
        cuts: asyncio.Queue = asyncio.Queue()  # Cut, a flush count, an exception, or None (the end)
        busy = {"pushing": False, "speaking": False}  # a piece in the segmenter; a segment taken by _spoken

        def check_idle() -> None:
            if idle and not any(busy.values()) and cuts.empty() and not segmenter.pending.strip():
                idle()

        async def read() -> None:
            flushes = 0

            async def cut(release_call, *args) -> None:
                # on a thread: a unit's front end (wetext) takes a while, and the event loop serves others
                for text in await asyncio.to_thread(release_call, *args):
                    cuts.put_nowait(Cut(text, segmenter.language))

            try:
                async for piece in pieces:
                    busy["pushing"] = True  # before any await: the piece is never unaccounted for
                    await cut(segmenter.push, piece.text)
                    if piece.flush:
                        await cut(segmenter.flush)
                        flushes += 1
                        cuts.put_nowait(flushes)
                    busy["pushing"] = False
                    check_idle()
                busy["pushing"] = True  # the end's text is cut: held until the request ends
                await cut(segmenter.end)
                cuts.put_nowait(None)
            except Exception as e:  # noqa: BLE001 (the consumer raises it, in order after what was cut before)
                cuts.put_nowait(e)

        async def cut_segments():
            while True:
                busy["speaking"] = False  # _spoken asks for the next cut: the one before is spoken
                check_idle()
                item = await cuts.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                busy["speaking"] = isinstance(item, Cut)
                yield item

        reader = asyncio.ensure_future(read())
        prompt = None if u.task == DESIGN else asyncio.ensure_future(self.prompts.encode(voice))  # meanwhile
        try:
            async with contextlib.aclosing(self._spoken(u, prompt, cut_segments())) as out:
                async for piece in out:
                    yield piece
        finally:
            for task in (reader, prompt):
                if task is not None:
                    task.cancel()  # (a prompt never awaited, for a stream with nothing to say, may have failed)
                    with contextlib.suppress(BaseException):
                        await task

    async def _spoken(
        self, u: Utterance, prompt, cuts: AsyncIterator[Cut | int], read_ahead: int = 1, later: list[Cut] = (),
    ) -> AsyncIterator[Piece]:  # fmt: skip
        """The audio of ``cuts`` (segments in speaking order, and flush counts) joined with the cross-fade,
        then the final piece. ``prompt``: an awaitable of the voice prompt (None: none), awaited at the first
        segment. A segment that is not ``last`` holds back the fade's samples; the last is known only at the
        end for a text stream, where they come with the final piece (the same samples either way).

        Starts under load (:attr:`starts`, :class:`~engine.start_window.StartWindow`): the first segment
        starts only while the window has a place among the utterances between their first segment's start
        and their first audio, or their plan (Instruct:
        a plan takes as many steps as it has tokens, and holding a place meanwhile would hold up every other
        start); the others wait, in arrival order. A stream's chunks and everyone else's share one delivery
        path (the vocoder, the sends), and the generator runs a new stream far ahead of its listener: a
        burst of new streams queues its chunks there in front of the next chunk of streams already playing,
        which then stall. Waiting for a place costs a new stream first-audio latency, never a stall; the
        place comes back as fast as the server delivers first audio (self-clocking), so a server that keeps
        up hardly waits.

        Read-ahead (``read_ahead`` K > 1; ``later``: all the cuts, a whole text's): once the first audio (or
        plan) is out, the segments after the one being played may generate meanwhile (:class:`_ReadAhead`);
        the audio, its order and the cross-fade are the same."""
        joiner, reasons, tail = Joiner(), [], np.zeros(0, np.float32)
        listener, i, ahead = _Listener(self.clock), 0, None
        try:
            async for cut in cuts:
                if isinstance(cut, int):  # all audio of the text up to flush `cut` is out (but the held fade)
                    yield Piece(np.zeros(0, np.float32), flushed=cut)
                    continue
                if i == 0 and prompt is not None:
                    prompt = await prompt
                if ahead is None and read_ahead > 1 and i > 0:  # (a first segment that sent no audio)
                    ahead = _ReadAhead(self, u, prompt, later, read_ahead, listener)
                segment = Segment(self.stream_ids(), cut.text, cut.language, prompt, u.params,
                                  segment_schedule(i, u.schedule, listener.held()), u.task, u.instruction)  # fmt: skip
                joiner.start_segment()
                start = None  # the first segment's place in the window until its first audio or plan is out
                if i == 0 and self.starts is not None:
                    start = await self.starts.acquire()  # a caller cancelled meanwhile takes no place
                try:
                    source = self._segment(segment) if ahead is None else ahead.current(i, segment)
                    async with contextlib.aclosing(source) as pieces:
                        async for audio, reason, text in pieces:
                            out = None if text is not None else joiner.push(audio, not cut.last)
                            if start is not None and (out is None or out.size):  # first audio or plan: the next starts
                                start.delivered()
                                start = None
                            if ahead is None and read_ahead > 1 and (out is None or out.size):  # later ones may start
                                ahead = _ReadAhead(self, u, prompt, later, read_ahead, listener)
                            if out is None:  # the plan: the first segment's goes out (the reference's choice)
                                if i == 0:
                                    yield Piece(np.zeros(0, np.float32), text=text)
                                continue
                            if reason:
                                reasons.append(reason)
                            if not cut.last or not reason:
                                if out.size:
                                    listener.out(out.size)
                                    if self.starts is not None:  # the window watches the listener within a segment
                                        self.starts.played(joiner, out.size / SAMPLE_RATE)
                                    yield Piece(out)
                            else:
                                tail = out  # the last segment's tail goes out with the final piece
                finally:
                    if start is not None:  # ended, failed or cancelled before any audio
                        start.abandoned()
                    if self.starts is not None:  # the next segment may wait for text: no verdict across
                        self.starts.stopped(joiner)
                i += 1
        finally:
            if ahead is not None:  # shielded: a caller cancelled again must not leave a stream open
                await asyncio.shield(linger(ahead.close()))
        reason = LENGTH if LENGTH in reasons else STOP
        yield Piece(np.concatenate([tail, joiner.finish()]), final=True, finish_reason=reason)

    async def _segment(self, segment: Segment) -> AsyncIterator[tuple[np.ndarray, str, str | None]]:
        """(audio, "", None) per chunk of one stream, then (its last audio, finish reason, None); a plan
        chunk gives (empty, "", its text) and never reaches the vocoder."""
        vocoder_ended = False  # the vocoder has had the stream's end (its last chunk)
        chunks = self.generator.stream(segment)
        try:
            async for chunk in chunks:
                if chunk.last and chunk.finish_reason == CANCELLED:
                    raise StreamFailed(ERROR + "the generator cancelled the stream")
                if chunk.plan:
                    yield np.zeros(0, np.float32), "", chunk.text
                    continue
                sent = self.starts.clock() if self.starts is not None else 0.0
                audio = await self.vocoder.decode(chunk)
                if self.starts is not None:  # the way out's time steers the start window
                    self.starts.carried(self.starts.clock() - sent)
                vocoder_ended = chunk.last
                if chunk.failed:
                    raise StreamFailed(chunk.finish_reason)
                yield audio.reshape(-1), chunk.finish_reason if chunk.last else "", None
                if chunk.last:
                    return
            raise StreamFailed(ERROR + "the generator stream ended without a last chunk")
        finally:
            # shielded: a caller cancelled again (or twice) must not cut the cleanup short
            await asyncio.shield(linger(self._close(chunks, segment.stream_id, vocoder_ended)))

    async def _close(self, chunks: AsyncIterator[Chunk], stream_id: int, vocoder_ended: bool) -> None:
        try:
            await chunks.aclose()  # cancels the generator stream unless it ended
        finally:
            # Even a stream the vocoder never opened: the vocoder keeps an issued stream openable until
            # its end arrives, however late (serving.flow.side_channel), so every stream's end goes there.
            if not vocoder_ended:
                await self.vocoder.decode(end_chunk(stream_id))


class _Listener:
    """The listener of one utterance: ``sent`` seconds of audio since ``began`` (the first audio out; None:
    none yet), as if playback began then and never stalled (engine.chunking's clock, at this end)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.began, self.sent = clock, None, 0.0

    def out(self, samples: int) -> None:
        self.began = self.clock() if self.began is None else self.began
        self.sent += samples / SAMPLE_RATE

    def held(self) -> float:
        """Seconds of audio the listener holds now (0 before the first audio)."""
        return 0.0 if self.began is None else self.sent - (self.clock() - self.began)


_END, _YIELDED = object(), object()  # a run's last item: its stream ended; it never had a slot


@dataclass(eq=False)
class _Run:
    """One segment generating ahead: its pieces wait in ``items`` (then _END, _YIELDED or the exception)."""

    index: int
    segment: Segment
    items: asyncio.Queue
    task: asyncio.Task | None = None
    ahead: bool = True  # not the segment being played yet: it is the first to yield its slot
    begun: bool = False  # its task ran (its stream has a slot, or is yielding)
    made: bool = False  # its first piece came (it surely has a slot), or it ended
    samples: int = 0  # audio in ``items``, not read yet


class _ReadAhead:
    """The segments after the one being played, generating meanwhile (an utterance's ``read_ahead`` K > 1).

    - **At once**: at most K of the utterance's segments generate together (the one being played counts),
      and no further one starts while the utterance holds ``read_ahead_seconds`` of audio made ahead and
      not yet sent (so a request buffers at most that plus what its running segments make).
    - **In order**: segments start ahead in speaking order, each as a stream of its own with the same seed,
      prompt and settings (:mod:`engine.segments`); their pieces wait in order, and the segment being played
      reads its own as they come, through the same cross-fade: the audio is the sequential audio.
    - **Fairness** (:func:`engine.segments.ahead_may_start`, :func:`~engine.segments.ahead_to_yield`): a
      segment starts ahead only while the generator has a free slot and no start waits for one (the
      slots' :meth:`~ReadAheadSlots.starts_waiting`); while starts wait, the newest segments running
      ahead are cancelled, their audio dropped, and run again later from scratch (same seed, same audio).
      The segment being played is never cancelled: once the listener reaches it, it is a start like any.
    - **Deadlines**: a segment's chunk schedule starts from what the listener holds when it starts (as a
      sequential one's does), less than it will hold when its audio plays: its chunks are never later than
      the deadline rule needs.
    """

    def __init__(self, orchestrator: Orchestrator, u: Utterance, prompt, cuts: list[Cut], k: int, listener: _Listener):
        self.o, self.u, self.prompt, self.cuts, self.k, self.listener = orchestrator, u, prompt, cuts, k, listener
        self.slots: ReadAheadSlots = orchestrator.slots
        self.bound = int(orchestrator.read_ahead_seconds * SAMPLE_RATE)
        self.index, self.playing = 0, True  # the segment being played; its stream is open (not ahead)
        self.runs: dict[int, _Run] = {}  # segments started ahead, by index (the one being played's too)
        self.yielding: set[asyncio.Task] = set()  # runs cancelled for a waiting start, until their slot is back
        self.wake = asyncio.Event()  # something changed here: the pump looks at once (else every poll)
        self.closed = False
        self.pump = asyncio.ensure_future(self._pump())

    def current(self, i: int, segment: Segment) -> AsyncIterator[tuple[np.ndarray, str, str | None]]:
        """The pieces of segment ``i``, now being played (``segment``: it, should it not have started ahead)."""
        self.index = i
        self.wake.set()
        run = self.runs.get(i)
        if run is not None and not run.begun:  # not on its way yet: it starts now, as any segment played
            del self.runs[i]
            run.task.cancel()
            run = None
        if run is None:  # nothing after it runs ahead either: runs start in order, the newest yields first
            return self._direct(segment)
        run.ahead, self.playing = False, False  # its run counts while it generates
        return self._read(run, segment)

    async def _direct(self, segment: Segment):
        self.playing = True
        try:
            async with contextlib.aclosing(self.o._segment(segment)) as pieces:
                async for item in pieces:
                    if item[1]:  # its stream ended
                        self.playing = False
                    yield item
        finally:
            self.playing = False

    async def _read(self, run: _Run, segment: Segment):
        try:
            while True:
                item = await run.items.get()
                if item is _END:
                    return
                if item is _YIELDED:  # it never had a slot: it starts now, as a segment being played does
                    async with contextlib.aclosing(self._direct(segment)) as pieces:
                        async for piece in pieces:
                            yield piece
                    return
                if isinstance(item, BaseException):
                    raise item
                run.samples -= item[0].size
                self.wake.set()
                yield item
        finally:
            self.runs.pop(run.index, None)
            if not run.task.done():  # the caller stopped early: its stream goes too
                run.task.cancel()
                await asyncio.wait({run.task})

    def _generating(self) -> int:
        return self.playing + sum(not r.task.done() for r in self.runs.values())

    def _next(self) -> int | None:
        """The next segment to start ahead: the first after the one being played that has not started."""
        j = self.index + 1
        while j in self.runs:
            if not self.runs[j].made:  # one at a time: it has its slot (or yielded) before the next starts
                return None
            j += 1
        return j if j < len(self.cuts) else None

    async def _pump(self) -> None:
        while not self.closed:
            running = sorted((r for r in self.runs.values() if r.ahead and not r.task.done()), key=lambda r: r.index)
            waiting = self.slots.starts_waiting()
            for _ in range(ahead_to_yield(waiting, len(self.yielding), len(running))):
                self._yield(running.pop())  # the newest first
            j = self._next()
            if (not waiting and j is not None and self._generating() < self.k
                    and sum(r.samples for r in self.runs.values()) < self.bound
                    and ahead_may_start(self.slots.free_slots(), waiting)):  # fmt: skip
                self._start(j)
                await asyncio.sleep(0)  # it takes its slot (or yields) before the next look
                continue
            waiter = asyncio.ensure_future(self.wake.wait())  # (not wait_for: 3.11's can swallow a cancel)
            try:
                await asyncio.wait({waiter}, timeout=AHEAD_POLL_SECONDS)
            finally:
                waiter.cancel()
            self.wake.clear()

    def _start(self, j: int) -> None:
        cut, u = self.cuts[j], self.u
        segment = Segment(self.o.stream_ids(), cut.text, cut.language, self.prompt, u.params,
                          segment_schedule(j, u.schedule, self.listener.held()), u.task, u.instruction, ahead=True)  # fmt: skip
        run = self.runs[j] = _Run(j, segment, asyncio.Queue())
        run.task = linger(self._run(run))  # a request waits for its streams' ends (engine.lifetime)

    def _yield(self, run: _Run) -> None:
        """Cancel a segment running ahead for a waiting start; it runs again later, from scratch."""
        del self.runs[run.index]
        run.task.cancel()
        self.yielding.add(run.task)
        run.task.add_done_callback(self.yielding.discard)  # done once its stream is closed (its slot back)

    async def _run(self, run: _Run) -> None:
        run.begun = True
        try:
            async with contextlib.aclosing(self.o._segment(run.segment)) as pieces:
                async for item in pieces:
                    run.samples += item[0].size
                    run.made = True
                    self.wake.set()
                    run.items.put_nowait(item)
            run.items.put_nowait(_END)
        except Yielded:  # the generator had no slot for it after all: run again later
            if self.runs.get(run.index) is run and run.ahead:
                del self.runs[run.index]
            run.items.put_nowait(_YIELDED)
        except Exception as e:  # noqa: BLE001 (raised in order, when the listener reaches this segment)
            run.items.put_nowait(e)
        finally:
            run.made = True
            self.wake.set()

    async def close(self) -> None:
        """Stop: every stream started ahead is closed (and waited for)."""
        self.closed = True
        self.pump.cancel()
        tasks = [self.pump, *(r.task for r in self.runs.values())]
        for task in tasks[1:]:
            task.cancel()
        await asyncio.wait(tasks)


async def stretched(pieces: AsyncIterator[Piece], speed: float) -> AsyncIterator[Piece]:
    """``pieces`` played ``speed`` times as fast at the same pitch, each piece's audio as soon as the
    stretcher has it (so no empty piece but the final one, which carries the stretcher's rest); closing
    this closes ``pieces``. The stretching runs on a thread: at speed 0.25 a 12-patch chunk takes 25-40 ms
    of CPU, which the event loop spends on the other requests' chunks meanwhile."""
    stretch = TimeStretch(speed)
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            if piece.text is not None or piece.flushed:  # the plan, a flush mark: no audio to stretch
                yield piece
                continue
            audio = await asyncio.to_thread(stretch.push, piece.audio)
            if piece.final:
                rest = await asyncio.to_thread(stretch.finish)
                yield Piece(np.concatenate([audio, rest]), final=True, finish_reason=piece.finish_reason)
                return
            if audio.size:
                yield Piece(audio)
