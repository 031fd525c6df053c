"""The text-in socket core every vendor's agent WebSocket speaks onto (docs/agents.md): many contexts on one
socket, each a text stream (:mod:`gateway.text_streams`) whose audio goes back as the context's encoder
makes it. A vendor's socket dialect (:mod:`gateway.dialects.cartesia_socket`,
:mod:`gateway.dialects.elevenlabs_socket`) is one file: it translates each message onto the core's
operations (:meth:`TextSocket.take` a :class:`Piece`, :meth:`~TextSocket.end`, :meth:`~TextSocket.cancel`,
:meth:`~TextSocket.touch`, :meth:`~TextSocket.finish`) and renders the core's events (a chunk, a unit's
timing, a flush's end, a context's end, an error) as its replies (:class:`Dialect`).

A flush makes the text sent so far one *unit*: spoken as its own segment, timed when its audio is complete
(the unit's text spread over its audio, :mod:`gateway.socket_audio`). ``end`` speaks the rest, then the
context's ``done``; ``cancel`` (barge-in, or the socket's close) stops its stream at once: its slot and
pages are freed and nothing more is sent for it.

Every refusal is an error reply naming what was refused (with the context when it could be read), then, for
a context, its end; nothing stays allocated for a refused or failed context. Bounds and the refusals' names:
:mod:`gateway.socket_bounds` (the same for every vendor). Replies never block what makes them: each
context's audio is read from the server as it comes and every reply goes into the socket's
:class:`gateway.outbox.Outbox` (all its contexts share the unsent-audio bound), which one writer sends, each
send within ``send_seconds``. A peer that does not read is cut (every context cancelled, the transport
aborted, one log line). Where a socket starts (admission, the shared count): :mod:`gateway.agent_sockets`.
Past 300 lines on purpose: one session's contexts, their order, flushes, cancels and bounds are one state
machine, TextSocket; what differs by vendor is in the dialects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from client.pace import Pace
from client.request import TTSError
from client.text_in import Flushed
from gateway.errors import APIError, from_tts_error
from gateway.outbox import ABORT, ClientNotReading, Cut, Outbox
from gateway.socket_audio import seconds
from gateway.socket_bounds import (
    BINARY,
    CONTEXT_IDLE,
    CONTEXT_TOO_LONG,
    ENDED,
    IDLE,
    NOT_TAKING,
    TOO_FAST,
    TOO_MANY_CONTEXTS,
    MessageRate,
    SocketBounds,
)  # fmt: skip
from gateway.socket_options import Options, ProtocolError, stream_fields
from gateway.text_streams import TextStreams

STOPPED_IDS_KEPT = 64  # cancelled or failed contexts whose late messages are ignored (the most recent ones)
CLOSE = object()  # in the outbox: the replies before it are out, close the socket


@dataclass(frozen=True)
class Piece:
    """A message's text for a context, in the core's terms."""

    text: str  # may be "" (only a flush, or only the end)
    flush: bool = False  # the text so far is a unit: speak it now, as its own segment
    acked: bool = False  # the client's own flush: the dialect's flush_done follows its audio
    end: bool = False  # no more text: the rest is spoken, then the context's done
    delay_s: float | None = None  # unflushed text is flushed after this long without more (None: never)


class Dialect(Protocol):
    """A vendor's replies (JSON objects; None: nothing to send) and its messages onto the core."""

    async def on_message(self, socket: TextSocket, text: str) -> None: ...
    def context_of(self, text: str) -> str | None: ...  # a message's context, read without taking it
    def chunk(self, ctx: Context, audio: bytes, at_ms: float) -> dict: ...
    # the text of units (maybe "" for audio after the last unit's text) over [start, end] seconds
    def timed(self, ctx: Context, text: str, start: float, end: float) -> dict | None: ...
    def flush_done(self, context_id: str, flush_id: int) -> dict | None: ...
    def done(self, context_id: str) -> dict | None: ...
    def error(self, context_id: str | None, status: int, message: str) -> dict: ...


class Context:
    """One context: its text stream, the task reading its audio, and what its replies need."""

    def __init__(self, context_id: str, options: Options, stream, pace: Pace | None = None):
        self.id, self.options, self.stream, self.pace = context_id, options, stream, pace
        self.output = options.output()  # push(float32 24 kHz) -> bytes, finish() -> bytes
        self.chars, self.ended, self.last_text = 0, False, time.monotonic()
        self.cancelled = False  # dropped: nothing more is sent for it (its iteration may still end normally)
        self.flushes = 0  # flushes sent to the stream
        self.flush_ids: dict[int, int] = {}  # stream flush number -> the client's flush number (acked)
        self.units: dict[int, str] = {}  # flush number -> the text sent before it (for timings)
        self.pending = ""  # text sent since the last flush
        self.last_piece: Piece | None = None  # the last piece taken (a dialect may read it)
        self.samples = self.timed_samples = self.timed_units = 0  # 24 kHz samples; units already timed
        self.reader: asyncio.Task | None = None
        self.delay: asyncio.Task | None = None  # the buffer delay's flush, armed after unflushed text


class TextSocket:
    """One client's socket in ``dialect``: ``await run()`` until it closes (or idles out)."""

    def __init__(self, ws, dialect: Dialect, open_text: TextStreams, voices: Callable[[], Awaitable[list[dict]]],
                 bounds: SocketBounds, unsent_seconds: float, peer: str = "unknown"):  # fmt: skip
        self.ws, self.dialect, self.open_text, self.voices, self.bounds = ws, dialect, open_text, voices, bounds
        self.contexts: dict[str, Context] = {}
        # a cancelled or failed context's later messages (tokens already on their way) are dropped, not taken
        # as a new context that would speak the rest of a sentence
        self.stopped: dict[str, None] = {}
        self.outbox = Outbox(unsent_seconds)  # replies not yet sent, with their audio: all contexts together
        self.cut = Cut((ws.scope.get("extensions") or {}).get(ABORT), peer, "an agent socket")
        self.closed = False  # the peer is gone, or the socket was cut: nothing more is sent
        self.finishing = False  # finish(): no new context; closed once the open ones are done
        self.rate = MessageRate(bounds.messages_per_second, bounds.message_burst)
        self.last_message = time.monotonic()

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch()),
                 asyncio.create_task(self.cut.done.wait())]  # fmt: skip
        try:
            await asyncio.wait([*tasks, writer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for ctx in list(self.contexts.values()):  # a closed socket cancels all its contexts
                await self._drop(ctx)
            if not self.closed:  # the replies queued (an idle socket's error) go out first, within send_seconds
                self.outbox.put(CLOSE)
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            writer.cancel()

    def send(self, reply: dict | None, samples: int = 0, pace: Pace | None = None) -> None:
        """Queue ``reply`` (carrying ``samples`` of 24 kHz audio of the stream paced by ``pace``) for the
        writer; past the unsent-audio bound the socket is cut."""
        if self.closed or reply is None:
            return
        try:
            self.outbox.put(json.dumps(reply), samples, pace)
        except ClientNotReading as e:
            self._cut(str(e))

    async def _write(self) -> None:
        """The socket's one writer: the outbox's replies in order, each taken by the socket within
        ``send_seconds`` or the socket is cut."""
        while True:
            reply = await self.outbox.get()
            try:
                async with asyncio.timeout(self.bounds.send_seconds):
                    await (self.ws.close() if reply is CLOSE else self.ws.send_text(reply))
                if reply is CLOSE:
                    self.closed = True
                    return
            except TimeoutError:
                self._cut(NOT_TAKING.format(s=self.bounds.send_seconds))
                return
            except Exception:  # noqa: BLE001 (the socket is gone: the receive loop ends it)
                self.closed = True
                return

    def _cut(self, reason: str) -> None:
        self.closed = True
        self.cut(reason)

    async def _receive(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                self.closed = True
                return
            self.last_message = time.monotonic()
            text = message.get("text")
            if text is None:
                self.send(self.dialect.error(None, 400, BINARY))
            elif not self.rate.take():
                await self.refuse(self.dialect.context_of(text), 429, TOO_FAST.format(
                    rate=self.bounds.messages_per_second, burst=self.bounds.message_burst))  # fmt: skip
            else:
                await self.dialect.on_message(self, text)

    # ---- the operations a dialect calls -------------------------------------------------------------------
    def context(self, context_id: str) -> Context | None:
        return self.contexts.get(context_id)

    async def take(self, context_id: str, piece: Piece, options: Options) -> None:
        """``piece`` for ``context_id``, opening it with ``options`` when it is not open."""
        if context_id in self.stopped:
            return
        ctx = self.contexts.get(context_id)
        try:
            if ctx is None:
                if piece.end and not piece.text.strip() and not piece.acked:
                    self.send(self.dialect.done(context_id))  # an end with nothing to say
                    return
                ctx = await self._open(context_id, options)
            elif ctx.ended:
                self.send(self.dialect.error(ctx.id, 400, ENDED))
                return
            await self._take(ctx, piece)
        except ProtocolError as e:
            await self.refuse(context_id, 400, str(e))
        except APIError as e:  # the address's share of streams is taken (gateway.shares)
            await self.refuse(context_id, e.status, e.message)
        except (TTSError, ConnectionError, TimeoutError) as e:
            answer = from_tts_error(e)
            await self.refuse(context_id, answer.status, answer.message)

    async def end(self, context_id: str) -> None:
        """No more text for the context: the rest is spoken, then its done."""
        ctx = self.contexts.get(context_id)
        if ctx is not None and not ctx.ended:
            await self._end(ctx)

    async def cancel(self, context_id: str) -> None:
        """Barge-in: the context stops now (slot and pages freed); nothing more is sent for it."""
        if (ctx := self.contexts.get(context_id)) is not None:
            await self._drop(ctx)

    def touch(self, context_id: str | None = None) -> None:
        """A keep-alive: the context (if open) is not idle."""
        if (ctx := self.contexts.get(context_id)) is not None:
            ctx.last_text = time.monotonic()

    async def finish(self) -> None:
        """Every open context is ended (its text spoken); the socket closes once they are done."""
        self.finishing = True
        for ctx in list(self.contexts.values()):
            if not ctx.ended:
                await self._end(ctx)
        self._close_if_finished()

    def _close_if_finished(self) -> None:
        if self.finishing and not self.contexts and not self.closed:
            self.outbox.put(CLOSE)

    # ---- text ---------------------------------------------------------------------------------------------
    async def _open(self, context_id: str, options: Options) -> Context:
        if self.finishing:
            raise ProtocolError("the socket is closing: no new context is opened", "context_id", context_id)
        if len(self.contexts) >= self.bounds.contexts:
            raise ProtocolError(TOO_MANY_CONTEXTS.format(n=self.bounds.contexts), "context_id", context_id)
        pace = Pace()  # what the writer takes paces the context's stream (gateway.outbox)
        stream = await self.open_text(**await stream_fields(options, self.voices, context_id), pace=pace)
        ctx = self.contexts[context_id] = Context(context_id, options, stream, pace)
        ctx.reader = asyncio.create_task(self._read(ctx))
        return ctx

    async def _take(self, ctx: Context, piece: Piece) -> None:
        ctx.chars += len(piece.text)
        if ctx.chars > self.bounds.context_chars:
            await self._fail(ctx, 413, CONTEXT_TOO_LONG.format(n=self.bounds.context_chars))
            return
        ctx.last_text, ctx.last_piece = time.monotonic(), piece
        if piece.text or piece.flush:
            await self._piece(ctx, piece.text, piece.flush, piece.acked)
        if ctx.delay is not None:
            ctx.delay.cancel()
            ctx.delay = None
        if piece.end:
            await self._end(ctx)
        elif ctx.pending and piece.delay_s is not None:
            ctx.delay = asyncio.create_task(self._flush_later(ctx, piece.delay_s))

    async def _end(self, ctx: Context) -> None:
        if ctx.delay is not None:
            ctx.delay.cancel()
            ctx.delay = None
        ctx.ended = True
        ctx.units[ctx.flushes + 1], ctx.pending = ctx.pending, ""  # the last unit
        await ctx.stream.end()

    async def _piece(self, ctx: Context, text: str, flush: bool, acked: bool = False) -> None:
        try:
            await ctx.stream.send(text, flush=flush)
        except ValueError:  # the server ended the stream (an error, its idle bound): its reader says so
            return
        ctx.pending += text
        if flush:
            ctx.flushes += 1
            ctx.units[ctx.flushes], ctx.pending = ctx.pending, ""
            if acked:
                ctx.flush_ids[ctx.flushes] = len(ctx.flush_ids) + 1

    async def _flush_later(self, ctx: Context, delay: float) -> None:
        await asyncio.sleep(delay)
        ctx.delay = None
        if not ctx.ended and ctx.pending:
            await self._piece(ctx, "", True)

    # ---- audio --------------------------------------------------------------------------------------------
    async def _read(self, ctx: Context) -> None:
        """The context's audio and markers -> its replies, then its done (or an error and its done)."""
        try:
            async for item in ctx.stream:
                if ctx.cancelled:
                    return
                if isinstance(item, Flushed):
                    self._timed(ctx, item.n)
                    if item.n in ctx.flush_ids:
                        self.send(self.dialect.flush_done(ctx.id, ctx.flush_ids[item.n]))
                else:
                    ctx.samples += item.audio.size
                    self._chunk(ctx, ctx.output.push(item.audio), item.audio.size)
            if ctx.cancelled:  # a cancelled text stream's iteration ends without an error
                return
            self._chunk(ctx, ctx.output.finish())
            self._timed(ctx, ctx.flushes + 1)
            self.send(self.dialect.done(ctx.id))
        except (TTSError, ConnectionError, TimeoutError) as e:
            if ctx.cancelled:
                return
            answer = from_tts_error(e)
            self._stop(ctx.id)
            self.send(self.dialect.error(ctx.id, answer.status, answer.message))
            self.send(self.dialect.done(ctx.id))
        finally:
            if self.contexts.get(ctx.id) is ctx:
                del self.contexts[ctx.id]
                if ctx.delay is not None:
                    ctx.delay.cancel()
            self._close_if_finished()

    def _chunk(self, ctx: Context, data: bytes, samples: int = 0) -> None:
        if data:
            self.send(self.dialect.chunk(ctx, data, 1000 * seconds(ctx.samples)), samples, ctx.pace)
        elif samples and ctx.pace is not None:  # the encoder holds them: they go with the next reply, taken
            ctx.pace.took(samples)

    def _timed(self, ctx: Context, n: int) -> None:
        """The units up to the ``n``-th, timed over the audio since the last timed unit."""
        text = " ".join(ctx.units.pop(k, "") for k in range(ctx.timed_units + 1, n + 1))
        start, end = seconds(ctx.timed_samples), seconds(ctx.samples)
        ctx.timed_units, ctx.timed_samples = max(ctx.timed_units, n), ctx.samples
        if text.strip() or end > start:  # text, or audio without (the last segment's cross-faded tail)
            self.send(self.dialect.timed(ctx, text, start, end))

    # ---- ends ---------------------------------------------------------------------------------------------
    async def _drop(self, ctx: Context) -> None:
        """Cancel a context now: its stream stops (slot and pages freed), nothing more is sent for it."""
        ctx.cancelled = True
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
        self._stop(ctx.id)
        for task in (ctx.reader, ctx.delay):
            if task is not None:
                task.cancel()
        await ctx.stream.cancel()
        self._close_if_finished()

    def _stop(self, context_id: str) -> None:
        self.stopped[context_id] = None
        while len(self.stopped) > STOPPED_IDS_KEPT:
            del self.stopped[next(iter(self.stopped))]

    async def _fail(self, ctx: Context, status: int, message: str) -> None:
        await self._drop(ctx)
        self.send(self.dialect.error(ctx.id, status, message))
        self.send(self.dialect.done(ctx.id))

    async def refuse(self, context_id: str | None, status: int, message: str) -> None:
        """A refused message: its context (if open) fails; a context it would have opened gets error and done."""
        if context_id in self.stopped:
            return
        ctx = self.contexts.get(context_id) if context_id is not None else None
        if ctx is not None:
            await self._fail(ctx, status, message)
            return
        self.send(self.dialect.error(context_id, status, message))
        if context_id is not None:
            self.send(self.dialect.done(context_id))

    async def _watch(self) -> None:
        """Returns when the socket has idled out; fails contexts left waiting for text."""
        b = self.bounds
        tick = min(1.0, b.idle_seconds / 4, b.context_idle_seconds / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if not self.contexts and now - self.last_message > b.idle_seconds:
                self.send(self.dialect.error(None, 408, IDLE.format(s=b.idle_seconds)))
                self.cut.closing(IDLE.format(s=b.idle_seconds))
                return
            for ctx in list(self.contexts.values()):
                if not ctx.ended and now - ctx.last_text > b.context_idle_seconds:
                    await self._fail(ctx, 408, CONTEXT_IDLE.format(s=b.context_idle_seconds))
