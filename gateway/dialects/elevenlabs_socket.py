"""ElevenLabs' text-to-speech WebSockets (docs/agents.md), onto the text-socket core (:mod:`gateway.text_socket`):
``/v1/text-to-speech/{voice_id}/multi-stream-input`` (many contexts; LiveKit's and Pipecat's ElevenLabs
services) and ``/stream-input`` (one context; the SDK's ``convert_realtime``).

Query parameters: ``output_format`` (the HTTP dialect's names, :data:`SOCKET_FORMATS`), ``language_code``,
``inactivity_timeout`` (seconds, 1..180, default 20: the socket's idle bound and its contexts', never above the
gateway's); ``model_id``, ``sync_alignment``, ``auto_mode``, ``apply_text_normalization`` and the rest are
taken; of them only ``auto_mode`` acts (each text message is spoken at once, as a unit).

Messages: ``text`` (the first message of a context, ``" "`` by convention, opens it with its
``voice_settings.speed`` and our extensions ``seed``, ``instructions``, ``parameters``); ``flush``: what was
sent is spoken now; on multi-stream-input, empty text or ``keep_alive: true`` keeps a context from idling;
``close_context`` right after a flush without text (how LiveKit and Pipecat end a turn) ends the context:
its text is spoken, then ``isFinal``; after text, or a second time, it means the client stopped listening
(both frameworks' barge-in): the context is cancelled at once (slot freed) and ``isFinal`` sent;
``close_socket``: every context is spoken to its end, then the socket closes. On stream-input, empty text
ends the input and the socket closes after the audio. ``try_trigger_generation`` and
``generation_config`` are taken without effect: the server speaks each sentence as soon as it is complete.

Replies: ``{"audio", "isFinal": false, "contextId"}``; after each unit's audio, one
``{"audio": "", "alignment", "normalizedAlignment"}`` whose ``chars`` are the unit's text spread over its
audio (times in ms from the unit's start, as Pipecat reads them; no aligner: approximate); ``{"isFinal":
true}`` ends a context; errors are ``{"error", "message", "code", "status"}`` (then ``isFinal`` on
multi-stream-input; on stream-input the error is the last reply before the socket closes).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace

from fastapi import FastAPI, WebSocket

from engine.params import SPEED, shown
from engine.protocol import surrogate_error
from gateway import cartesia
from gateway.agent_sockets import Sockets, serve
from gateway.cartesia import MAX_CONTEXT_ID_CHARS, MAX_MESSAGE_CHARS
from gateway.dialects.elevenlabs_http import DEFAULT_FORMAT, OUTPUT_FORMATS, STATUSES
from gateway.encode import Encoder
from gateway.socket_audio import char_times
from gateway.socket_bounds import SocketBounds
from gateway.socket_options import Options, ProtocolError
from gateway.text_socket import Context, Piece, TextSocket

SOCKET_FORMATS = {name: f for name, f in OUTPUT_FORMATS.items() if not name.startswith("wav_")}  # raw, codecs
INACTIVITY = (1, 180, 20)  # ElevenLabs' inactivity_timeout: least, most, default (seconds)
POLICY = 1008  # the close code of a refused handshake
DEFAULT_CONTEXT = ""  # stream-input's one context (and multi-stream-input's when a message names none)


@dataclass(frozen=True)
class Query:
    """The socket's query parameters, read once at the handshake."""

    voice_id: str  # the path's: a registered voice's name, a stock voice, or "default"
    encoding: str  # gateway.encode's format
    sample_rate: int
    language: str | None
    inactivity_seconds: float
    auto_mode: bool


def read_query(voice_id: str, params) -> Query:
    """The handshake's query -> :class:`Query`; :class:`ProtocolError` naming the parameter."""
    name = params.get("output_format", DEFAULT_FORMAT)
    if name not in SOCKET_FORMATS:
        raise ProtocolError(f"output_format {shown(name)} is not made on the socket; these are: "
                            f"{', '.join(SOCKET_FORMATS)}", "output_format")  # fmt: skip
    encoding, rate = SOCKET_FORMATS[name]
    try:
        language = cartesia.language(params.get("language_code"))
    except ProtocolError as e:
        raise ProtocolError(str(e).replace("language", "language_code", 1), "language_code") from None
    least, most, default = INACTIVITY
    timeout = params.get("inactivity_timeout", str(default))
    if not timeout.isdigit() or not least <= int(timeout) <= most:
        raise ProtocolError(f"inactivity_timeout must be an integer in {least}..{most}, got {shown(timeout)}",
                            "inactivity_timeout")  # fmt: skip
    auto = params.get("auto_mode", "false").lower()
    if auto not in ("true", "false"):
        raise ProtocolError(f"auto_mode must be true or false, got {shown(auto)}", "auto_mode")
    if problem := surrogate_error("voice_id", voice_id):
        raise ProtocolError(problem, "voice_id")
    return Query(voice_id, encoding, rate, language, float(timeout), auto == "true")


class ElevenLabsSocket:
    """The dialect (:class:`gateway.text_socket.Dialect`) for one socket; ``multi``: multi-stream-input."""

    def __init__(self, query: Query, multi: bool):
        self.query, self.multi = query, multi
        self.failed = False  # stream-input: its one context failed; the socket closes at the input's end

    async def on_message(self, socket: TextSocket, text: str) -> None:
        try:
            body = self._body(text)
            context_id = self._context_id(body)
        except ProtocolError as e:
            await socket.refuse(e.context_id, 400, str(e))
            return
        words = body.get("text") or ""
        if body.get("close_socket") is True:
            await socket.finish()
        elif body.get("close_context") is True and self.multi:
            await self._close(socket, context_id)
        elif not self.multi and body.get("text") == "":  # stream-input's end of text
            await socket.finish()
        elif self.failed:
            return
        elif not words and not body.get("flush"):  # a keep-alive
            socket.touch(context_id)
        else:
            try:
                options = self._options(body, context_id)
            except ProtocolError as e:
                await socket.refuse(context_id, 400, str(e))
                return
            acked = body.get("flush") is True
            auto = self.query.auto_mode and bool(words.strip())
            await socket.take(context_id, Piece(words, flush=acked or auto, acked=acked), options)

    async def _close(self, socket: TextSocket, context_id: str) -> None:
        """close_context after a flush without text (LiveKit's and Pipecat's end of a turn): the context is
        spoken to its end, then isFinal. After text, or a second time (the client stopped listening: both
        frameworks' barge-in): it is cancelled at once, its slot freed, and isFinal sent."""
        ctx = socket.context(context_id)
        last = ctx.last_piece if ctx is not None else None
        if ctx is not None and not ctx.ended and last is not None and last.flush and not last.text.strip():
            await socket.end(context_id)
            return
        await socket.cancel(context_id)  # nothing, if none is open under that id
        socket.send(self.done(context_id))

    def _body(self, text: str) -> dict:
        if len(text) > MAX_MESSAGE_CHARS:
            raise ProtocolError(f"a message is at most {MAX_MESSAGE_CHARS} characters", "message")
        try:
            body = json.loads(text)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            raise ProtocolError("a message must be a JSON object", "message")
        return body

    def _context_id(self, body: dict) -> str:
        context_id = body.get("context_id", body.get("contextId")) if self.multi else None
        if context_id is None:
            return DEFAULT_CONTEXT
        if not isinstance(context_id, str) or not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
            raise ProtocolError(f"context_id must be a string of 1 to {MAX_CONTEXT_ID_CHARS} characters", "context_id")
        if problem := surrogate_error("context_id", context_id):
            raise ProtocolError(problem, "context_id")
        return context_id

    def _options(self, body: dict, context_id: str) -> Options:
        def fail(message: str, name: str):
            raise ProtocolError(message, name, context_id)

        words = body.get("text")
        if words is not None and not isinstance(words, str):
            fail(f"text must be a string, got {type(words).__name__}", "text")
        if problem := surrogate_error("text", words or ""):
            fail(problem, "text")
        if not isinstance(body.get("flush", False), bool):
            fail("flush must be true or false", "flush")
        settings = body.get("voice_settings") or {}
        if not isinstance(settings, dict):
            fail("voice_settings must be an object", "voice_settings")
        speed = None
        if settings.get("speed") is not None:
            try:
                speed = SPEED.parse(settings["speed"])
            except ValueError as e:
                fail(f"voice_settings.speed: {e}", "voice_settings.speed")
        extensions = cartesia.extensions(body, fail)
        q = self.query

        def output():
            return Encoder(q.encoding, q.sample_rate)

        return Options(q.voice_id, q.language, output, True, speed, extensions.get("instructions"),
                       extensions.get("seed"), extensions.get("parameters"))  # fmt: skip

    def context_of(self, text: str) -> str | None:
        try:
            return self._context_id(self._body(text))
        except ProtocolError:
            return None

    # ---- replies ------------------------------------------------------------------------------------------
    def _tagged(self, reply: dict, context_id: str | None) -> dict:
        if self.multi and context_id:
            reply["contextId"] = context_id
        return reply

    def chunk(self, ctx: Context, audio: bytes, at_ms: float) -> dict:
        reply = {"audio": base64.b64encode(audio).decode(), "isFinal": False, "normalizedAlignment": None,
                 "alignment": None}  # fmt: skip
        return self._tagged(reply, ctx.id)

    def timed(self, ctx: Context, text: str, start: float, end: float) -> dict:
        aligned = alignment(text, end - start)
        reply = {"audio": "", "isFinal": False, "normalizedAlignment": aligned, "alignment": aligned}
        return self._tagged(reply, ctx.id)

    def flush_done(self, context_id: str, flush_id: int) -> None:
        return None  # ElevenLabs has no such reply

    def done(self, context_id: str) -> dict | None:
        return None if self.failed else self._tagged({"isFinal": True}, context_id)

    def error(self, context_id: str | None, status: int, message: str) -> dict:
        if not self.multi and context_id is not None:
            self.failed = True
        reply = {"error": message, "message": message, "code": status, "status": STATUSES.get(status, "error")}
        return self._tagged(reply, context_id)


def alignment(text: str, seconds: float) -> dict:
    """A unit's characters spread over its ``seconds`` of audio, in ElevenLabs' socket shape (ms from the
    unit's start; each start plus its duration reaches the next start, the last the unit's end). Audio
    without text (the cross-faded tail of the last sentence, which comes after its unit was timed) is a space."""
    if not text.strip():
        return {"chars": [" "], "charStartTimesMs": [0], "charDurationsMs": [round(1000 * seconds)]}
    chars, starts, ends = char_times(text, 0.0, seconds)
    starts_ms = [round(1000 * s) for s in starts]
    ends_ms = [round(1000 * e) for e in ends]
    return {"chars": chars, "charStartTimesMs": starts_ms,
            "charDurationsMs": [max(0, e - s) for s, e in zip(starts_ms, ends_ms, strict=True)]}  # fmt: skip


def add_routes(app: FastAPI, sockets: Sockets) -> None:
    """Both sockets. ``xi-api-key`` / ``authorization`` (a header, or in a first message) are taken, not checked."""

    async def run(ws: WebSocket, voice_id: str, multi: bool) -> None:
        try:
            query = read_query(voice_id, ws.query_params)
        except ProtocolError as e:
            dialect = ElevenLabsSocket(Query(voice_id, "pcm", 24000, None, 20.0, False), multi)
            await serve(ws, dialect, sockets, refusal=(400, str(e), POLICY))
            return
        await serve(ws, ElevenLabsSocket(query, multi), sockets, narrowed(sockets.bounds, query.inactivity_seconds))

    @app.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
    async def multi_stream_input(ws: WebSocket, voice_id: str):
        await run(ws, voice_id, True)

    @app.websocket("/v1/text-to-speech/{voice_id}/stream-input")
    async def stream_input(ws: WebSocket, voice_id: str):
        await run(ws, voice_id, False)


def narrowed(bounds: SocketBounds, inactivity_seconds: float) -> SocketBounds:
    """The gateway's bounds with the socket's ``inactivity_timeout`` as its idle bounds (never above them)."""
    return replace(bounds, idle_seconds=min(bounds.idle_seconds, inactivity_seconds),
                   context_idle_seconds=min(bounds.context_idle_seconds, inactivity_seconds))  # fmt: skip
