"""Cartesia's TTS WebSocket messages (docs/agents.md), without the socket: a client's JSON message to a typed
request, and the replies the agent plugins read, shaped so that each of them reads them (LiveKit tells audio
by a non-empty ``data`` and tests ``done`` before ``type``; Pipecat needs ``context_id`` on every reply).

Every malformed message is a :class:`ProtocolError` naming the field, with the context it came from when
that was readable, so that the error reply can carry it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from engine import instructions
from engine.params import SPEED, UTTERANCE_PARAMETERS, shown
from engine.protocol import surrogate_error
from engine.text import canonical_language
from gateway.rates import RATES
from gateway.socket_options import ProtocolError
from serving.contract import SEED_RANGE, is_seed

ENCODINGS = ("pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw")  # Cartesia's output_format.encoding
MAX_MESSAGE_CHARS = 64 * 1024  # a text message: a sentence or a token, with the options around it
MAX_CONTEXT_ID_CHARS = 256
# Cartesia's language codes (ISO 639-1; Pipecat adds a region: en-US) -> the model's names
LANGUAGE_CODES = {
    "zh": "Chinese", "en": "English", "yue": "Cantonese", "ja": "Japanese", "ko": "Korean", "es": "Spanish",
    "fr": "French", "ru": "Russian", "ar": "Arabic", "tr": "Turkish", "id": "Indonesian", "pt": "Portuguese",
    "it": "Italian", "nl": "Dutch", "vi": "Vietnamese", "de": "German", "uk": "Ukrainian", "th": "Thai",
    "pl": "Polish", "ro": "Romanian", "el": "Greek", "cs": "Czech", "fi": "Finnish", "hi": "Hindi",
}  # fmt: skip


@dataclass(frozen=True)
class Generate:
    """Text for a context: the first message of a context opens it (its options hold for the context)."""

    context_id: str  # the client's id for the utterance; replies carry it
    transcript: str  # this message's text ("" or " " with more=False: only the end)
    more: bool  # Cartesia's "continue": more text will follow in this context
    voice_id: str  # voice.id: a registered voice's name (or "default")
    language: str | None  # the model's name for it (None: detect)
    encoding: str  # one of ENCODINGS, raw samples (the WebSocket has no other container)
    sample_rate: int  # Hz, one of gateway.rates.RATES
    timestamps: bool  # add_timestamps: word timings wanted
    buffer_delay_ms: int | None  # max_buffer_delay_ms: 0 = speak each message now; None = the server's default
    flush: bool  # Cartesia's flush: true (neither plugin sends it)
    speed: float | None = None  # generation_config.speed: our speed parameter (time-stretched, same pitch)
    volume: float | None = None  # generation_config.volume: a gain on the samples, 0.5..2.0 as Cartesia's
    # extensions (docs/agents.md): Instruct's voice design, our seed and utterance parameters
    instructions: str | None = None  # a voice description: designs a voice (with a stock voice or default)
    seed: int | None = None
    parameters: dict | None = None  # engine.params.UTTERANCE_PARAMETERS by name, as /v1/audio/speech takes them


@dataclass(frozen=True)
class Cancel:
    """Stop a context now: nothing more is sent for it."""

    context_id: str


def parse_message(text: str) -> Generate | Cancel:
    """A client's text frame -> the request it makes; :class:`ProtocolError` for anything else."""
    if len(text) > MAX_MESSAGE_CHARS:
        raise ProtocolError(f"a message is at most {MAX_MESSAGE_CHARS} characters", "message")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise ProtocolError("a message must be a JSON object", "message") from None
    if not isinstance(body, dict):
        raise ProtocolError("a message must be a JSON object", "message")
    context_id = body.get("context_id")
    if not isinstance(context_id, str) or not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
        raise ProtocolError(f"context_id must be a string of 1 to {MAX_CONTEXT_ID_CHARS} characters", "context_id")
    if problem := surrogate_error("context_id", context_id):  # replies carry it: they could not be sent
        raise ProtocolError(problem, "context_id")
    if body.get("cancel") is True:
        return Cancel(context_id)
    return Generate(context_id, **_options(body, context_id))


def _options(body: dict, context_id: str) -> dict:
    def fail(message: str, name: str):
        raise ProtocolError(message, name, context_id)

    transcript, more = body.get("transcript", ""), body.get("continue", False)
    if not isinstance(transcript, str):
        fail(f"transcript must be a string, got {type(transcript).__name__}", "transcript")
    if problem := surrogate_error("transcript", transcript):
        fail(problem, "transcript")
    if not isinstance(more, bool):
        fail("continue must be true or false", "continue")
    voice = voice_id(body.get("voice"), fail)
    out = output_format(body.get("output_format"), fail)
    delay = body.get("max_buffer_delay_ms")
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 5000):
        fail(f"max_buffer_delay_ms must be an integer in 0..5000, got {shown(delay)}", "max_buffer_delay_ms")
    flags = {name: body.get(name, False) for name in ("add_timestamps", "flush")}
    for name, value in flags.items():
        if not isinstance(value, bool):
            fail(f"{name} must be true or false", name)
    return dict(
        **generation_config(body.get("generation_config"), fail),
        **extensions(body, fail),
        transcript=transcript,
        more=more,
        voice_id=voice,
        language=language(body.get("language"), context_id),
        encoding=out.encoding,
        sample_rate=out.sample_rate,
        timestamps=flags["add_timestamps"],
        buffer_delay_ms=delay,
        flush=flags["flush"],
    )


def voice_id(voice, fail) -> str:
    """Cartesia's ``voice``: an id string (the SDK's ``voice="<id>"``), ``{"id": ...}`` or ``{"mode": "id",
    "id": ...}`` -> the id (a registered voice's name, or default)."""
    if isinstance(voice, dict) and voice.get("mode", "id") == "id":
        voice = voice.get("id")
    if not isinstance(voice, str):
        fail('voice must be a voice id, or {"mode": "id", "id": "<a registered voice, or default>"}', "voice")
    if problem := surrogate_error("voice.id", voice):
        fail(problem, "voice.id")
    return voice


@dataclass(frozen=True)
class OutputFormat:
    """Cartesia's ``output_format``."""

    container: str  # one of the endpoint's containers: raw (the socket, SSE), wav, mp3 (/tts/bytes)
    encoding: str | None  # one of ENCODINGS (None for mp3)
    sample_rate: int  # Hz, one of gateway.rates.RATES
    bit_rate: int | None = None  # mp3's, in bits a second


MP3_BIT_RATES = (32000, 64000, 96000, 128000, 192000)  # Cartesia's output_format.bit_rate values


def output_format(out, fail, containers: tuple[str, ...] = ("raw",)) -> OutputFormat:
    """Cartesia's ``output_format`` with a container of ``containers`` -> :class:`OutputFormat`."""
    if not isinstance(out, dict):
        fail('output_format must be {"container": "raw", "encoding": ..., "sample_rate": ...}', "output_format")
    container = out.get("container", "raw")
    if container not in containers:
        fail(f"output_format.container must be one of {list(containers)}, got {shown(container)}",
             "output_format.container")  # fmt: skip
    rate = out.get("sample_rate")
    if isinstance(rate, bool) or rate not in RATES:
        fail(f"output_format.sample_rate must be one of {list(RATES)}, got {shown(rate)}", "output_format.sample_rate")
    if container == "mp3":
        bit_rate = out.get("bit_rate")
        if bit_rate is not None and (isinstance(bit_rate, bool) or bit_rate not in MP3_BIT_RATES):
            fail(f"output_format.bit_rate must be one of {list(MP3_BIT_RATES)}, got {shown(bit_rate)}",
                 "output_format.bit_rate")  # fmt: skip
        return OutputFormat(container, None, rate, bit_rate)
    if out.get("encoding") not in ENCODINGS:
        fail(f"output_format.encoding must be one of {list(ENCODINGS)}, got {shown(out.get('encoding'))}",
             "output_format.encoding")  # fmt: skip
    return OutputFormat(container, out["encoding"], rate)


VOLUMES = (0.5, 2.0)  # Cartesia's range for generation_config.volume
EXTENSION_PARAMETERS = {p.name: p for p in UTTERANCE_PARAMETERS if p.name != "speed"}  # speed: generation_config


def generation_config(config, fail) -> dict:
    """Cartesia's ``generation_config`` (sonic-3: speed, volume, emotion) -> speed and volume."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        fail("generation_config must be an object {speed, volume}", "generation_config")
    if config.get("emotion"):
        fail("generation_config.emotion is not supported: describe the voice in instructions (an extension, "
             "docs/agents.md) instead", "generation_config.emotion")  # fmt: skip
    out = {}
    if config.get("speed") is not None:
        try:
            out["speed"] = SPEED.parse(config["speed"])
        except ValueError as e:
            fail(f"generation_config.speed: {e}", "generation_config.speed")
    volume = config.get("volume")
    if volume is not None:
        lo, hi = VOLUMES
        if isinstance(volume, bool) or not isinstance(volume, int | float) or not lo <= volume <= hi:
            fail(f"generation_config.volume must be a number in {lo}..{hi}, got {shown(volume)}",
                 "generation_config.volume")  # fmt: skip
        out["volume"] = float(volume)
    return out


def extensions(body: dict, fail) -> dict:
    """Ours, not Cartesia's: ``instructions`` (design a voice), ``seed``, ``parameters`` {name: value}."""
    out = {}
    if body.get("instructions") is not None:
        try:
            out["instructions"] = instructions.check_instruction(body["instructions"], "instructions")
        except ValueError as e:
            fail(str(e), "instructions")
    seed = body.get("seed")
    if seed is not None:
        if not is_seed(seed):
            fail(f"seed must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {shown(seed)}", "seed")
        out["seed"] = seed
    given = body.get("parameters")
    if given is not None:
        if not isinstance(given, dict):
            fail("parameters must be an object {name: value}", "parameters")
        for name, value in given.items():
            if name not in EXTENSION_PARAMETERS:
                fail(f"parameters.{name} is unknown; known: {', '.join(EXTENSION_PARAMETERS)}", "parameters")
            try:
                EXTENSION_PARAMETERS[name].parse(value)
            except ValueError as e:
                fail(str(e), f"parameters.{name}")
        out["parameters"] = dict(given)
    return out


def language(value, context_id: str | None = None) -> str | None:
    """Cartesia's ``language`` (``en``, ``en-US``; or one of our names, or ``auto``) -> the model's name."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"language must be a string, got {type(value).__name__}", "language", context_id)
    code = value.strip().lower().split("-")[0]
    if code in LANGUAGE_CODES:
        return LANGUAGE_CODES[code]
    if code == "auto":
        return None
    try:
        return canonical_language(value)
    except ValueError:
        message = f"language {shown(value)} is not spoken here; codes: {', '.join(LANGUAGE_CODES)}"
        raise ProtocolError(message, "language", context_id) from None


# ---- replies ----------------------------------------------------------------------------------------------
def chunk(context_id: str, audio: bytes, step_ms: float) -> dict:
    """Audio (never empty: LiveKit reads an empty ``data`` as no audio)."""
    if not audio:
        raise ValueError("a chunk carries audio")
    return {"type": "chunk", "data": base64.b64encode(audio).decode(), "done": False, "status_code": 206,
            "step_time": round(step_ms, 3), "context_id": context_id}  # fmt: skip


def timestamps(context_id: str, words: list[str], start: list[float], end: list[float]) -> dict:
    """Word timings in seconds from the context's start (Pipecat builds the bot's transcript from them)."""
    if not len(words) == len(start) == len(end):
        raise ValueError("words, start and end have one entry a word")
    return {"type": "timestamps", "done": False, "status_code": 206, "context_id": context_id,
            "word_timestamps": {"words": words, "start": start, "end": end}}  # fmt: skip


def flush_done(context_id: str, flush_id: int) -> dict:
    return {"type": "flush_done", "done": False, "flush_done": True, "flush_id": flush_id, "status_code": 206,
            "context_id": context_id}  # fmt: skip


def done(context_id: str) -> dict:
    """The context's end: its last reply."""
    return {"type": "done", "done": True, "status_code": 200, "context_id": context_id}


# status -> (Cartesia's title, error_code): the SDK shows an error as "title: message"
TITLES = {
    400: ("Invalid request", "invalid_request"), 403: ("Forbidden", "forbidden"), 404: ("Not found", "not_found"),
    408: ("Timed out", "timeout"), 413: ("Too long", "request_too_large"), 429: ("Too many requests", "rate_limited"),
    500: ("Server error", "internal_error"), 503: ("Service unavailable", "unavailable"), 504: ("Timed out", "timeout"),
}  # fmt: skip


def error_fields(status_code: int, message: str) -> dict:
    """What Cartesia's errors carry and its SDK prints: ``title``, ``message``, ``status_code``, ``error_code``
    (and ``error``, the message, which the agent plugins read)."""
    title, code = TITLES.get(status_code, ("Server error" if status_code >= 500 else "Invalid request", None))
    return {"title": title, "message": message, "error": message, "status_code": status_code, "error_code": code}


def error(context_id: str | None, status_code: int, message: str) -> dict:
    """An error, without ``done`` (LiveKit would read it as an end): send :func:`done` after it when the
    context is known. ``context_id`` None (a message whose context could not be read) is sent as "": Pipecat
    fails without one, and both plugins pass over a context they do not hold."""
    return {"type": "error", **error_fields(status_code, message), "context_id": context_id or ""}
