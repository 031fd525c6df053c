"""Cartesia's HTTP TTS (docs/agents.md): ``POST /tts/bytes`` (the audio, as LiveKit's ``TTS.synthesize()``,
Pipecat's ``CartesiaHttpTTSService`` and the SDK's ``tts.generate`` / ``tts.bytes`` ask for it) and
``POST /tts/sse`` (the SDK's ``tts.sse``: ``chunk`` events of base64 audio, ``timestamps`` when asked, ``done``).

The fields are the socket's (:mod:`gateway.cartesia` parses both): ``transcript``, ``voice`` (an id string,
``{"id"}`` or ``{"mode": "id", "id"}``), ``output_format``, ``language``, ``generation_config`` (speed,
volume), ``add_timestamps``, our extensions; each becomes the core's field of the same meaning. Errors are
Cartesia's shape, what its SDK prints (``title``, ``message``) with ``status_code`` and ``error_code``.
"""

from __future__ import annotations

import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from engine.protocol import surrogate_error
from gateway import cartesia
from gateway.cartesia import ProtocolError
from gateway.dialects.whole_text import Core, answered
from gateway.encode import wav_header
from gateway.errors import APIError
from gateway.socket_audio import word_times

# Cartesia's raw encodings -> the encoders' formats (gateway.encode)
FORMATS = {"pcm_s16le": "pcm", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "pcm_mulaw", "pcm_alaw": "pcm_alaw"}
BYTES_CONTAINERS = ("raw", "wav", "mp3")  # /tts/bytes; /tts/sse is raw only, as Cartesia's reference has it
# the core's field names -> Cartesia's, for an error's param
FIELDS = {"input": "transcript", "speed": "generation_config.speed", "voice": "voice"}


def request_fields(body: dict, containers: tuple[str, ...]) -> tuple[dict, cartesia.OutputFormat, float | None]:
    """Cartesia's body -> (the core's fields, its output_format, volume); APIError 400 naming the field."""

    def fail(message: str, name: str):
        raise APIError(400, message, name)

    transcript = body.get("transcript")
    if not isinstance(transcript, str) or not transcript.strip():
        fail("transcript must be a non-empty string", "transcript")
    if problem := surrogate_error("transcript", transcript):
        fail(problem, "transcript")
    voice = cartesia.voice_id(body.get("voice"), fail)
    out = cartesia.output_format(body.get("output_format"), fail, containers)
    try:
        language = cartesia.language(body.get("language"))
    except ProtocolError as e:
        fail(str(e), e.field)
    config = cartesia.generation_config(body.get("generation_config"), fail)
    extensions = cartesia.extensions(body, fail)
    fields = {"input": transcript, "voice": voice, "language": language, "speed": config.get("speed"),
              "seed": extensions.get("seed"), "instructions": extensions.get("instructions"),
              **extensions.get("parameters", {})}  # fmt: skip
    return fields, out, config.get("volume")


def encoder_format(out: cartesia.OutputFormat) -> str:
    """The encoder's format for ``out`` (a wav container: its encoding's raw samples, after a header)."""
    return "mp3" if out.container == "mp3" else FORMATS[out.encoding]


def error_body(e: APIError, request: Request) -> dict:
    """Cartesia's error: what its SDK prints (``title: message``), the status and a code, the field at fault."""
    param = FIELDS.get(e.param, e.param)
    return {**cartesia.error_fields(e.status, e.message), "param": param,
            "request_id": request.headers.get("x-request-id")}  # fmt: skip


def add_routes(app: FastAPI, core: Core) -> None:
    """``POST /tts/bytes`` and ``POST /tts/sse``. Headers ``X-API-Key`` and ``Cartesia-Version`` are taken and
    not checked (the speech routes take any key)."""

    @app.post("/tts/bytes")
    @answered(error_body)
    async def tts_bytes(request: Request):
        fields, out, volume = request_fields(await core.body(request), BYTES_CONTAINERS)
        response, _ = await core.speak(fields, request, encoder_format(out), out.sample_rate, volume)
        if out.container != "wav":
            return response
        wav = after(wav_header(out.sample_rate, encoder_format(out)), response.body_iterator)
        return StreamingResponse(wav, media_type="audio/wav", headers=plan_headers(response))

    @app.post("/tts/sse")
    @answered(error_body)
    async def tts_sse(request: Request):
        body = await core.body(request)
        fields, out, volume = request_fields(body, ("raw",))
        timestamps = body.get("add_timestamps", False)
        if not isinstance(timestamps, bool):
            raise APIError(400, "add_timestamps must be true or false", "add_timestamps")
        context_id = body.get("context_id")
        if context_id is not None and not isinstance(context_id, str):
            raise APIError(400, "context_id must be a string", "context_id")
        response, tally = await core.speak(fields, request, encoder_format(out), out.sample_rate, volume)
        words = fields["input"] if timestamps else None
        events = sse_events(response.body_iterator, tally, words, context_id)
        return StreamingResponse(events, media_type="text/event-stream", headers=plan_headers(response))


async def after(head: bytes, pieces):
    """``head``, then the core's audio bytes (a WAV header before the raw samples of any encoding)."""
    yield head
    async with contextlib.aclosing(pieces) as chunks:
        async for data in chunks:
            yield data


def plan_headers(response: StreamingResponse) -> dict:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("x-")}


async def sse_events(pieces, tally, transcript: str | None, context_id: str | None):
    """The core's audio bytes as Cartesia's SSE events: ``chunk`` (base64 of the raw samples), then, with
    ``transcript``, one ``timestamps`` event (its words spread over the whole audio: there is no aligner), and
    ``done``. A failure after the first chunk cuts the connection (:func:`gateway.streaming.cut_short`), as on
    ``/v1/audio/speech``: the answer is broken, never one that passes for complete."""
    async with contextlib.aclosing(pieces) as chunks:
        async for data in chunks:
            if data:
                yield sse("chunk", cartesia.chunk(context_id, data, 1000 * tally.seconds))
    if transcript is not None:
        yield sse("timestamps", cartesia.timestamps(context_id, *word_times(transcript, 0.0, tally.seconds)))
    yield sse("done", cartesia.done(context_id))


def sse(name: str, event: dict) -> str:
    """One SSE event; ``context_id`` only when the request gave one (the SDK's is optional)."""
    if not event.get("context_id"):
        event = {k: v for k, v in event.items() if k != "context_id"}
    return f"event: {name}\ndata: {json.dumps(event)}\n\n"
