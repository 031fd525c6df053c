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
import secrets
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
from engine.params import DEFAULT_SCHEDULE, DEFAULT_SPLIT_TOKENS, SPEED, GenerationParams
from engine.protocol import CANCELLED, ERROR, LENGTH, SAMPLE_RATE, STOP, Chunk, StreamFailed, end_chunk
from engine.segments import Joiner, segment_schedule
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
        that cancels the stream and frees its slot."""


class Vocoder(Protocol):
    async def decode(self, chunk: Chunk) -> np.ndarray:
        """One chunk -> (n,) float32 samples finished by it (the rest of the stream with ``last``)."""


PREPARED_KEPT = 512  # texts whose front-end result an orchestrator keeps (the least recently used goes)


def new_stream_id() -> int:
    """Random 63-bit ids: unguessable, never 0, and far from Triton's own sequence ids."""
    return secrets.randbits(63) | 1


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
    ):
        """``clock``: seconds of a monotonic clock, for what the listener holds as a later segment starts;
        ``starts``: the start window (None: none; see :meth:`_spoken`)."""
        self.prompts, self.generator, self.vocoder = prompts, generator, vocoder
        self.starts = starts  # first come, first served
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

        async with contextlib.aclosing(self._spoken(u, _ready(prompt), cuts())) as pieces:
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

    async def _spoken(self, u: Utterance, prompt, cuts: AsyncIterator[Cut | int]) -> AsyncIterator[Piece]:
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
        up hardly waits."""
        joiner, reasons, tail = Joiner(), [], np.zeros(0, np.float32)
        # the listener: `sent` seconds of audio since `began` (the first audio out; None: none yet), as if
        # playback began then and never stalled (engine.chunking's clock, at this end of the pipeline)
        began, sent, i = None, 0.0, 0
        async for cut in cuts:
            if isinstance(cut, int):  # all audio of the text up to flush `cut` is out (but the held fade)
                yield Piece(np.zeros(0, np.float32), flushed=cut)
                continue
            if i == 0 and prompt is not None:
                prompt = await prompt
            held = 0.0 if began is None else sent - (self.clock() - began)
            segment = Segment(self.stream_ids(), cut.text, cut.language, prompt, u.params,
                              segment_schedule(i, u.schedule, held), u.task, u.instruction)  # fmt: skip
            joiner.start_segment()
            start = None  # the first segment's place in the window until its first audio or plan is out
            if i == 0 and self.starts is not None:
                start = await self.starts.acquire()  # a caller cancelled meanwhile takes no place
            try:
                async with contextlib.aclosing(self._segment(segment)) as pieces:
                    async for audio, reason, text in pieces:
                        out = None if text is not None else joiner.push(audio, not cut.last)
                        if start is not None and (out is None or out.size):  # first audio or plan: the next starts
                            start.delivered()
                            start = None
                        if out is None:  # the plan: the first segment's goes out (the reference's choice)
                            if i == 0:
                                yield Piece(np.zeros(0, np.float32), text=text)
                            continue
                        if reason:
                            reasons.append(reason)
                        if not cut.last or not reason:
                            if out.size:
                                began = self.clock() if began is None else began
                                sent += out.size / SAMPLE_RATE
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
                audio = await self.vocoder.decode(chunk)
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
