"""ElevenLabs' HTTP text-to-speech (docs/agents.md): ``POST /v1/text-to-speech/{voice_id}`` and ``/stream`` (the
audio: the SDK's ``text_to_speech.convert`` / ``.stream``, LiveKit's ``TTS.synthesize()``), their
``/with-timestamps`` variants (audio and character alignment: one JSON object, or JSON lines as it streams),
``GET /v1/voices`` and, for a caller that sends ``xi-api-key``, ``GET /v1/models`` in ElevenLabs' shape.

Fields: ``text``; ``voice_id`` (path) is this server's voice name; the ``output_format`` query parameter
names the encoding and rate (:data:`OUTPUT_FORMATS`); ``language_code``; ``voice_settings.speed`` is our
speed; ``seed``. ``model_id``, the other ``voice_settings``, ``previous_text``/``next_text`` and the rest are
taken and have no effect here (docs/agents.md says which). Character times are approximate: the same
spread of the text over its audio as the socket's word timings (:func:`gateway.socket_audio.char_times`).
Errors: ``{"detail": {"status", "message", "param"}}``.
"""

from __future__ import annotations

import base64
import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from client.request import TTSError
from engine.params import shown
from engine.protocol import surrogate_error
from gateway import cartesia
from gateway.cartesia import ProtocolError
from gateway.dialects.whole_text import Core, Tally, answered
from gateway.errors import APIError, from_tts_error
from gateway.rates import RATES
from gateway.socket_audio import char_times

MODEL_ID = "fireredtts3"
DEFAULT_FORMAT = "mp3_44100_128"  # ElevenLabs' default output_format
# ElevenLabs' output_format names -> (the encoders' format, rate); the bit rate in an mp3_/opus_ name is not
# honoured: MP3 is 64 kb/s and Opus 32 kb/s here (gateway.encode.BIT_RATES)
OUTPUT_FORMATS = {
    **{f"pcm_{r}": ("pcm", r) for r in RATES},
    **{f"wav_{r}": ("wav", r) for r in RATES},
    "ulaw_8000": ("pcm_mulaw", 8000),
    "alaw_8000": ("pcm_alaw", 8000),
    **{f"mp3_{r}_{k}": ("mp3", r) for r, k in [(22050, 32), (24000, 48)] + [(44100, k) for k in (32, 64, 96, 128, 192)]},
    **{f"opus_48000_{k}": ("opus", 48000) for k in (32, 64, 96, 128, 192)},
}  # fmt: skip
# taken and without effect here (docs/agents.md): ElevenLabs' request fields this server has no use for
IGNORED = {"model_id", "pronunciation_dictionary_locators", "previous_text", "next_text", "previous_request_ids",
           "next_request_ids", "use_pvc_as_ivc", "apply_text_normalization", "apply_language_text_normalization",
           "audio_effects", "enable_logging", "optimize_streaming_latency"}  # fmt: skip
EXTENSIONS = {"seed", "instructions", "parameters"}  # seed: ElevenLabs'; the others ours (docs/agents.md)
VOICE_SETTINGS = {"stability", "similarity_boost", "style", "use_speaker_boost", "speed", "clone_strength"}
FIELDS = {"input": "text", "speed": "voice_settings.speed", "voice": "voice_id"}  # core -> ElevenLabs, for param
STATUSES = {400: "invalid_request", 403: "forbidden", 404: "not_found", 408: "timeout", 413: "request_too_large",
            429: "too_many_requests", 500: "internal_error", 503: "service_unavailable", 504: "timeout"}  # fmt: skip


def output_format(name) -> tuple[str, int]:
    if name not in OUTPUT_FORMATS:
        raise APIError(400, f"output_format {shown(name)} is not made here; these are: {', '.join(OUTPUT_FORMATS)}",
                       "output_format")  # fmt: skip
    return OUTPUT_FORMATS[name]


def request_fields(body: dict, voice_id: str) -> dict:
    """ElevenLabs' body and path voice -> the core's fields; APIError 400 naming the field."""
    text = body.get("text")
    if not isinstance(text, str) or not text.strip():
        raise APIError(400, "text must be a non-empty string", "text")
    if problem := surrogate_error("text", text):
        raise APIError(400, problem, "text")
    unknown = sorted(set(body) - IGNORED - {"text", "language_code", "voice_settings", *EXTENSIONS})
    if unknown:
        raise APIError(400, f"unknown fields: {shown(unknown)}", unknown[0])
    settings = body.get("voice_settings") or {}
    if not isinstance(settings, dict) or set(settings) - VOICE_SETTINGS:
        raise APIError(400, f"voice_settings is an object of {sorted(VOICE_SETTINGS)}", "voice_settings")
    try:
        language = cartesia.language(body.get("language_code"))  # the same ISO 639-1 codes as Cartesia's
    except ProtocolError as e:
        raise APIError(400, str(e).replace("language", "language_code", 1), "language_code") from None
    extensions = cartesia.extensions(body, fail)  # ElevenLabs' seed, and ours as on Cartesia's socket
    return {"input": text, "voice": voice_id, "language": language, "speed": settings.get("speed"),
            "seed": extensions.get("seed"), "instructions": extensions.get("instructions"),
            **extensions.get("parameters", {})}  # fmt: skip


def fail(message: str, name: str):
    raise APIError(400, message, name)


def error_body(e: APIError, request: Request) -> dict:
    return {"detail": {"status": STATUSES.get(e.status, "error"), "message": e.message,
                       "param": FIELDS.get(e.param, e.param)}}  # fmt: skip


def add_routes(app: FastAPI, core: Core) -> None:
    """The four text-to-speech routes and ``GET /v1/voices``. ``xi-api-key`` is taken and not checked."""

    async def speak(request: Request, voice_id: str):
        fmt, rate = output_format(request.query_params.get("output_format", DEFAULT_FORMAT))
        fields = request_fields(await core.body(request), voice_id)
        response, tally = await core.speak(fields, request, fmt, rate)
        return response, tally, fields["input"]

    async def audio(request: Request, voice_id: str):
        response, _, _ = await speak(request, voice_id)
        return response

    async def with_timestamps(request: Request, voice_id: str):
        response, tally, text = await speak(request, voice_id)
        # read whole before answering (the times need the audio's length); a failure midway cuts the connection
        data = b"".join([piece async for piece in response.body_iterator])
        return {"audio_base64": base64.b64encode(data).decode(), **alignments(text, tally)}

    async def stream_with_timestamps(request: Request, voice_id: str):
        response, tally, text = await speak(request, voice_id)
        return StreamingResponse(json_lines(response.body_iterator, tally, text), media_type="application/json")

    for path, route in [("", audio), ("/stream", audio), ("/with-timestamps", with_timestamps),
                        ("/stream/with-timestamps", stream_with_timestamps)]:  # fmt: skip
        app.add_api_route(f"/v1/text-to-speech/{{voice_id}}{path}", answered(error_body)(route), methods=["POST"])

    @app.get("/v1/voices")
    @answered(error_body)
    async def voices(request: Request):
        try:
            listed = await core.voices()
        except (TTSError, ConnectionError, TimeoutError) as e:
            raise from_tts_error(e) from None
        return {"voices": [voice("default", "premade")] + [voice(v["name"], "cloned") for v in listed]}


def voice(name: str, category: str) -> dict:
    """A voice in ElevenLabs' shape (``voice_id`` is the name the routes take)."""
    return {"voice_id": name, "name": name, "category": category, "labels": {}, "description": None,
            "preview_url": None, "settings": None}  # fmt: skip


def asks_for_models(request: Request) -> bool:
    """``GET /v1/models`` is both OpenAI's and ElevenLabs': a caller with ElevenLabs' key header gets ElevenLabs'
    list (its SDK sends ``xi-api-key``; OpenAI's sends ``Authorization``), any other OpenAI's."""
    return "xi-api-key" in request.headers


def models() -> list[dict]:
    """``GET /v1/models`` in ElevenLabs' shape: a bare list."""
    languages = [{"language_id": code, "name": name} for code, name in cartesia.LANGUAGE_CODES.items()]
    return [{"model_id": MODEL_ID, "name": "FireRedTTS3", "can_do_text_to_speech": True,
             "can_do_voice_conversion": False, "can_use_speaker_boost": False, "can_use_style": False,
             "description": "FireRedTTS3 on Triton", "languages": languages}]  # fmt: skip


def alignments(text: str, tally: Tally) -> dict:
    """ElevenLabs' ``alignment`` (the text as sent) and ``normalized_alignment`` (the same here: the server's
    normalized text is not returned), each character over the whole audio."""
    chars, starts, ends = char_times(text, 0.0, tally.seconds)
    alignment = {"characters": chars, "character_start_times_seconds": starts, "character_end_times_seconds": ends}
    return {"alignment": alignment, "normalized_alignment": alignment}


async def json_lines(pieces, tally: Tally, text: str):
    """The core's audio bytes as ElevenLabs' streamed lines ``{"audio_base64", "alignment",
    "normalized_alignment"}``: each piece is held until the next arrives, so the last line carries the whole
    text's alignment (times need the audio's length); the others carry none."""
    held = None
    async with contextlib.aclosing(pieces) as chunks:
        async for data in chunks:
            if not data:
                continue
            if held is not None:
                yield line(held, None)
            held = data
    yield line(held or b"", alignments(text, tally))


def line(data: bytes, aligned: dict | None) -> str:
    empty = {"alignment": None, "normalized_alignment": None}
    return json.dumps({"audio_base64": base64.b64encode(data).decode(), **(aligned or empty)}) + "\n"
