"""Cartesia's TTS WebSocket (``/tts/websocket``), as LiveKit's and Pipecat's Cartesia plugins speak it
(docs/agents.md): many contexts on one socket, each a text stream (:mod:`gateway.text_streams`) whose
audio goes back as base64 chunks in the asked encoding and rate, then ``done``.

A message with ``max_buffer_delay_ms: 0`` (both plugins' default) is sent and flushed: one message, one
segment boundary. Otherwise its text waits for a sentence end or the buffer delay (Cartesia's default 3 s
without a new message), then is flushed. ``continue: false`` ends the context; a ``cancel`` (or the socket's
close) cancels it at once: its stream stops and frees its slot, and nothing more is sent for it.

Every refusal is an ``error`` reply naming what was refused (with the context when it could be read), then,
for a context, its ``done``; nothing stays allocated for a refused or failed context. Bounds and the
refusals' names: :mod:`gateway.socket_bounds`.

Replies never block what makes them: each context's audio is read from the server as it comes and every
reply goes into the socket's :class:`gateway.outbox.Outbox` (all its contexts share the unsent-audio
bound), which one writer sends, each send within ``send_seconds``. A peer that does not read is cut
(every context cancelled, the transport aborted, one log line): no bound's watchdog waits on a send.
Past 300 lines on purpose: one WebSocket session's protocol (contexts, their order, flushes, cancels, bounds)
is one state machine, AgentSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

from client.request import TTSError
from client.text_in import Flushed
from gateway import cartesia
from gateway.cartesia import Cancel, Generate, ProtocolError, parse_message
from gateway.errors import from_tts_error
from gateway.fields import STOCK_VOICES, WITH_A_VOICE
from gateway.outbox import ABORT, ClientNotReading, Cut, Outbox, log
from gateway.socket_audio import RawOutput, seconds, word_times
from gateway.socket_bounds import (
    BINARY,
    CONTEXT_IDLE,
    CONTEXT_TOO_LONG,
    ENDED,
    IDLE,
    NOT_TAKING,
    TOO_FAST,
    TOO_MANY_CONTEXTS,
    TRY_AGAIN_LATER,
    MessageRate,
    OpenSockets,
    SocketBounds,
)  # fmt: skip
from gateway.text_streams import TextStreams

DEFAULT_BUFFER_DELAY_MS = 3000  # Cartesia's max_buffer_delay_ms when a message leaves it out
STOPPED_IDS_KEPT = 64  # cancelled or failed contexts whose late messages are ignored (the most recent ones)
CLOSE = object()  # in the outbox: the replies before it are out, close the socket


class Context:
    """One context: its text stream, the task reading its audio, and what its replies need."""

    def __init__(self, request: Generate, stream):
        self.id, self.stream = request.context_id, stream
        self.output = RawOutput(request.encoding, request.sample_rate, request.volume)
        self.timestamps = request.timestamps
        self.chars, self.ended, self.last_text = 0, False, time.monotonic()
        self.cancelled = False  # dropped: nothing more is sent for it (its iteration may still end normally)
        self.flushes = 0  # flushes sent to the stream
        self.flush_ids: dict[int, int] = {}  # stream flush number -> the client's flush_id (flush: true)
        self.units: dict[int, str] = {}  # flush number -> the text sent before it (for timings)
        self.pending = ""  # text sent since the last flush
        self.samples = self.timed_samples = self.timed_units = 0  # 24 kHz samples; units already timed
        self.reader: asyncio.Task | None = None
        self.delay: asyncio.Task | None = None  # the buffer delay's flush, armed after unflushed text


class AgentSocket:
    """One client's socket: ``await run()`` until it closes (or idles out)."""

    def __init__(self, ws, open_text: TextStreams, voices: Callable[[], Awaitable[list[dict]]], bounds: SocketBounds,
                 unsent_seconds: float, peer: str = "unknown"):  # fmt: skip
        self.ws, self.open_text, self.voices, self.bounds = ws, open_text, voices, bounds
        self.contexts: dict[str, Context] = {}
        # a cancelled or failed context's later messages (tokens already on their way) are dropped, not taken
        # as a new context that would speak the rest of a sentence
        self.stopped: dict[str, None] = {}
        self.outbox = Outbox(unsent_seconds)  # replies not yet sent, with their audio: all contexts together
        self.cut = Cut((ws.scope.get("extensions") or {}).get(ABORT), peer, "an agent socket")
        self.closed = False  # the peer is gone, or the socket was cut: nothing more is sent
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

    def send(self, reply: dict, samples: int = 0) -> None:
        """Queue ``reply`` (carrying ``samples`` of 24 kHz audio) for the writer; past the unsent-audio bound
        the socket is cut."""
        if self.closed:
            return
        try:
            self.outbox.put(json.dumps(reply), samples)
        except ClientNotReading as e:
            self._cut(str(e))

    async def _write(self) -> None:
        """The socket's one writer: the outbox's replies in order, each taken by the socket within
        ``send_seconds`` or the socket is cut."""
        while True:
            reply = await self.outbox.get()
            try:
                if reply is CLOSE:
                    await asyncio.wait_for(self.ws.close(), self.bounds.send_seconds)
                    self.closed = True
                    return
                await asyncio.wait_for(self.ws.send_text(reply), self.bounds.send_seconds)
            except TimeoutError:
                self._cut(NOT_TAKING.format(s=self.bounds.send_seconds))
                return
            except Exception:  # noqa: BLE001 (the socket is gone: the receive loop ends it)
                self.closed = True
                return

    def _cut(self, reason: str) -> None:
        self.closed = True
        self.cut(reason)

    # ---- messages ---------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                self.closed = True
                return
            self.last_message = time.monotonic()
            text = message.get("text")
            if text is None:
                self.send(cartesia.error(None, 400, BINARY))
            elif not self.rate.take():
                await self._refuse(_readable_context(text), 429, TOO_FAST.format(
                    rate=self.bounds.messages_per_second, burst=self.bounds.message_burst))  # fmt: skip
            else:
                await self._on_text(text)

    async def _on_text(self, text: str) -> None:
        try:
            request = parse_message(text)
        except ProtocolError as e:
            await self._refuse(e.context_id, 400, str(e))
            return
        ctx = self.contexts.get(request.context_id)
        if request.context_id in self.stopped:
            return
        if isinstance(request, Cancel):
            if ctx is not None:
                await self._drop(ctx)
            return
        try:
            if ctx is None:
                ctx = await self._open(request)
                if ctx is None:
                    return
            elif ctx.ended:
                self.send(cartesia.error(ctx.id, 400, ENDED))
                return
            await self._take(ctx, request)
        except ProtocolError as e:
            await self._refuse(request.context_id, 400, str(e))
        except (TTSError, ConnectionError, TimeoutError) as e:
            answer = from_tts_error(e)
            await self._refuse(request.context_id, answer.status, answer.message)

    async def _open(self, request: Generate) -> Context | None:
        if not request.more and not request.transcript.strip() and not request.flush:
            self.send(cartesia.done(request.context_id))  # an end with nothing to say
            return None
        if len(self.contexts) >= self.bounds.contexts:
            raise ProtocolError(TOO_MANY_CONTEXTS.format(n=self.bounds.contexts), "context_id", request.context_id)
        stream = await self.open_text(**await self._stream_fields(request))
        ctx = self.contexts[request.context_id] = Context(request, stream)
        ctx.reader = asyncio.create_task(self._read(ctx))
        return ctx

    async def _stream_fields(self, request: Generate) -> dict:
        """The context's options -> the fields of ``AsyncTTSClient.stream`` (voices as the speech route names them)."""
        out = {"language": request.language}
        for name in ("seed", "speed", "parameters"):
            if getattr(request, name) is not None:
                out[name] = getattr(request, name)
        voice = request.voice_id
        if voice != "default":
            if voice in {v["name"] for v in await self.voices()}:
                if request.instructions is not None:
                    raise ProtocolError(WITH_A_VOICE, "instructions", request.context_id)
                out["voice_id"] = voice
            elif voice not in STOCK_VOICES:
                message = f"voice {voice!r} is not registered (GET /v1/audio/voices lists them)"
                raise ProtocolError(message, "voice", request.context_id)
        if request.instructions is not None:
            out["instruction"] = request.instructions
        return out

    async def _take(self, ctx: Context, request: Generate) -> None:
        ctx.chars += len(request.transcript)
        if ctx.chars > self.bounds.context_chars:
            await self._fail(ctx, 413, CONTEXT_TOO_LONG.format(n=self.bounds.context_chars))
            return
        ctx.last_text = time.monotonic()
        flush = request.more and (request.flush or request.buffer_delay_ms == 0)
        if request.transcript or flush:
            await self._piece(ctx, request.transcript, flush, by_client=request.flush)
        if ctx.delay is not None:
            ctx.delay.cancel()
            ctx.delay = None
        if not request.more:
            ctx.ended = True
            ctx.units[ctx.flushes + 1], ctx.pending = ctx.pending, ""  # the last unit
            await ctx.stream.end()
        elif ctx.pending:
            delay = request.buffer_delay_ms if request.buffer_delay_ms is not None else DEFAULT_BUFFER_DELAY_MS
            ctx.delay = asyncio.create_task(self._flush_later(ctx, delay / 1000))

    async def _piece(self, ctx: Context, text: str, flush: bool, by_client: bool = False) -> None:
        try:
            await ctx.stream.send(text, flush=flush)
        except ValueError:  # the server ended the stream (an error, its idle bound): its reader says so
            return
        ctx.pending += text
        if flush:
            ctx.flushes += 1
            ctx.units[ctx.flushes], ctx.pending = ctx.pending, ""
            if by_client:
                ctx.flush_ids[ctx.flushes] = len(ctx.flush_ids) + 1

    async def _flush_later(self, ctx: Context, delay: float) -> None:
        await asyncio.sleep(delay)
        ctx.delay = None
        if not ctx.ended and ctx.pending:
            await self._piece(ctx, "", True)

    # ---- audio ------------------------------------------------------------------------------------------
    async def _read(self, ctx: Context) -> None:
        """The context's audio and markers -> its replies, then ``done`` (or ``error`` and ``done``)."""
        try:
            async for item in ctx.stream:
                if ctx.cancelled:
                    return
                if isinstance(item, Flushed):
                    await self._timed(ctx, item.n)
                    if item.n in ctx.flush_ids:
                        self.send(cartesia.flush_done(ctx.id, ctx.flush_ids[item.n]))
                else:
                    ctx.samples += item.audio.size
                    await self._chunk(ctx, ctx.output.push(item.audio), item.audio.size)
            if ctx.cancelled:  # a cancelled text stream's iteration ends without an error
                return
            await self._chunk(ctx, ctx.output.finish())
            await self._timed(ctx, ctx.flushes + 1)
            self.send(cartesia.done(ctx.id))
        except (TTSError, ConnectionError, TimeoutError) as e:
            if ctx.cancelled:
                return
            answer = from_tts_error(e)
            self._stop(ctx.id)
            self.send(cartesia.error(ctx.id, answer.status, answer.message))
            self.send(cartesia.done(ctx.id))
        finally:
            if self.contexts.get(ctx.id) is ctx:
                del self.contexts[ctx.id]
                if ctx.delay is not None:
                    ctx.delay.cancel()

    async def _chunk(self, ctx: Context, data: bytes, samples: int = 0) -> None:
        if data:
            self.send(cartesia.chunk(ctx.id, data, 1000 * seconds(ctx.samples)), samples)

    async def _timed(self, ctx: Context, n: int) -> None:
        """Word timings of the units up to the ``n``-th, spread over the audio since the last timed unit."""
        text = " ".join(ctx.units.pop(k, "") for k in range(ctx.timed_units + 1, n + 1))
        words, start, end = word_times(text, seconds(ctx.timed_samples), seconds(ctx.samples))
        ctx.timed_units, ctx.timed_samples = max(ctx.timed_units, n), ctx.samples
        if words and ctx.timestamps:
            self.send(cartesia.timestamps(ctx.id, words, start, end))

    # ---- ends -------------------------------------------------------------------------------------------
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

    def _stop(self, context_id: str) -> None:
        self.stopped[context_id] = None
        while len(self.stopped) > STOPPED_IDS_KEPT:
            del self.stopped[next(iter(self.stopped))]

    async def _fail(self, ctx: Context, status: int, message: str) -> None:
        await self._drop(ctx)
        self.send(cartesia.error(ctx.id, status, message))
        self.send(cartesia.done(ctx.id))

    async def _refuse(self, context_id: str | None, status: int, message: str) -> None:
        """A refused message: its context (if open) fails; a context it would have opened gets error and done."""
        if context_id in self.stopped:
            return
        ctx = self.contexts.get(context_id) if context_id is not None else None
        if ctx is not None:
            await self._fail(ctx, status, message)
            return
        self.send(cartesia.error(context_id, status, message))
        if context_id is not None:
            self.send(cartesia.done(context_id))

    async def _watch(self) -> None:
        """Returns when the socket has idled out; fails contexts left waiting for text."""
        b = self.bounds
        tick = min(1.0, b.idle_seconds / 4, b.context_idle_seconds / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if not self.contexts and now - self.last_message > b.idle_seconds:
                self.send(cartesia.error(None, 408, IDLE.format(s=b.idle_seconds)))
                self.cut.closing(IDLE.format(s=b.idle_seconds))
                return
            for ctx in list(self.contexts.values()):
                if not ctx.ended and now - ctx.last_text > b.context_idle_seconds:
                    await self._fail(ctx, 408, CONTEXT_IDLE.format(s=b.context_idle_seconds))


def _readable_context(text: str) -> str | None:
    """The context of a message refused before parsing (too many messages), when it can be read at all."""
    try:
        return parse_message(text).context_id
    except ProtocolError as e:
        return e.context_id


async def serve_socket(ws, open_text: TextStreams, voices, bounds: SocketBounds, open_sockets: OpenSockets,
                       unsent_seconds: float) -> None:  # fmt: skip
    """Accept ``ws`` and run it, within the gateway's socket bounds (``open_sockets``, shared); ``unsent_seconds``:
    the audio its peer may leave untaken (:mod:`gateway.outbox`)."""
    host = ws.client.host if ws.client else "unknown"
    peer = f"{host}:{ws.client.port}" if ws.client else host
    refusal = open_sockets.refusal(host)
    if refusal is not None:
        log.warning("an agent socket from %s refused: %s", peer, refusal)
        with contextlib.suppress(Exception):  # a new socket's buffers are empty: this cannot wait long
            await ws.accept()
            await asyncio.wait_for(ws.send_text(json.dumps(cartesia.error(None, 503, refusal))), bounds.send_seconds)
            await asyncio.wait_for(ws.close(TRY_AGAIN_LATER), bounds.send_seconds)
        return
    open_sockets.open(host)  # before the first await: the next connection sees it
    try:
        await ws.accept()
        await AgentSocket(ws, open_text, voices, bounds, unsent_seconds, peer).run()
    finally:
        open_sockets.close(host)
