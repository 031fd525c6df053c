"""Cartesia's TTS WebSocket (``/tts/websocket``), as LiveKit's and Pipecat's Cartesia plugins speak it
(docs/agents.md), onto the text-socket core (:mod:`gateway.text_socket`): its messages
(:mod:`gateway.cartesia`) become the core's operations, the core's events its replies.

A message with ``max_buffer_delay_ms: 0`` (both plugins' default) is sent and flushed: one message, one
unit. Otherwise its text waits for a sentence end or the buffer delay (Cartesia's default 3 s without a
new message), then is flushed. ``flush: true`` is the client's own flush (``flush_done`` follows its audio).
``continue: false`` ends the context; a ``cancel`` (or the socket's close) cancels it at once. Word timings
(``add_timestamps``) come as ``timestamps`` once a unit's audio is complete; every context ends with
``done``, after an ``error`` when it failed.
"""

from __future__ import annotations

from gateway import cartesia
from gateway.cartesia import Cancel, Generate, parse_message
from gateway.socket_audio import RawOutput, word_times
from gateway.socket_options import Options, ProtocolError
from gateway.text_socket import Context, Piece, TextSocket

DEFAULT_BUFFER_DELAY_MS = 3000  # Cartesia's max_buffer_delay_ms when a message leaves it out


class CartesiaSocket:
    """The dialect (:class:`gateway.text_socket.Dialect`); it holds nothing of its own."""

    async def on_message(self, socket: TextSocket, text: str) -> None:
        try:
            request = parse_message(text)
        except ProtocolError as e:
            await socket.refuse(e.context_id, 400, str(e))
            return
        if isinstance(request, Cancel):
            await socket.cancel(request.context_id)
            return
        await socket.take(request.context_id, piece(request), options(request))

    def context_of(self, text: str) -> str | None:
        try:
            return parse_message(text).context_id
        except ProtocolError as e:
            return e.context_id

    def chunk(self, ctx: Context, audio: bytes, at_ms: float) -> dict:
        return cartesia.chunk(ctx.id, audio, at_ms)

    def timed(self, ctx: Context, text: str, start: float, end: float) -> dict | None:
        words, starts, ends = word_times(text, start, end)
        return cartesia.timestamps(ctx.id, words, starts, ends) if words and ctx.options.timestamps else None

    def flush_done(self, context_id: str, flush_id: int) -> dict:
        return cartesia.flush_done(context_id, flush_id)

    def done(self, context_id: str) -> dict:
        return cartesia.done(context_id)

    def error(self, context_id: str | None, status: int, message: str) -> dict:
        return cartesia.error(context_id, status, message)


def piece(request: Generate) -> Piece:
    delay = request.buffer_delay_ms if request.buffer_delay_ms is not None else DEFAULT_BUFFER_DELAY_MS
    flush = request.more and (request.flush or delay == 0)
    return Piece(request.transcript, flush=flush, acked=request.more and request.flush, end=not request.more,
                 delay_s=delay / 1000)  # fmt: skip


def options(request: Generate) -> Options:
    def output():
        return RawOutput(request.encoding, request.sample_rate, request.volume)

    return Options(request.voice_id, request.language, output, request.timestamps, request.speed,
                   request.instructions, request.seed, request.parameters)  # fmt: skip
