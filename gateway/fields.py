"""The fields of a speech request (OpenAI's, plus our parameters), from a JSON body or a query string, to
keyword arguments of ``AsyncTTSClient.stream``. Every malformed value is an :class:`APIError` 400 whose
``param`` names the field, before anything is sent to the server."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping

from client.request import TTSError
from engine import instructions
from engine.params import UTTERANCE_PARAMETERS, shown
from engine.protocol import surrogate_error
from gateway.encode import FORMATS
from gateway.errors import APIError, from_tts_error
from gateway.rates import check_rate
from serving.contract import MAX_TEXT_CHARS, SEED_RANGE, is_seed

# OpenAI's stock voice names: they mean the default voice here (and with instructions, a voice designed from
# them), unless a voice of that name is registered
# (the openai SDK's literals for speech's voice, 3.57 and 6.x alike)
STOCK_VOICES = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                "marin", "cedar"}  # fmt: skip
STREAM_FORMATS = ("audio", "sse")
EXTRAS = {p.name: p for p in UTTERANCE_PARAMETERS}  # our parameters, as request fields
STRINGS = ("model", "input", "response_format", "stream_format", "language", "instructions")
NUMBERS = ("seed", "sample_rate")  # numbers that are not one of EXTRAS (OpenAI's speed is ours too)
KNOWN = {*STRINGS, "voice", *NUMBERS, *EXTRAS}
JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


class Described:
    """Stands for a client's list or object in an error message: the repr of a deeply nested one can
    exceed the recursion limit, as its parsing nearly did."""

    def __init__(self, value):
        self.text = "a list" if isinstance(value, list) else "an object"

    def __repr__(self) -> str:
        return self.text


def described(value):
    return Described(value) if isinstance(value, list | dict) else value


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; 400 for what is not one (nested 1,000 deep included)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to be a speech request") from None
    except ValueError as e:  # also bytes that are not UTF-8, and integers of over 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def from_query(query: Mapping[str, str]) -> dict:
    """``GET /v1/audio/speech``'s query parameters -> the body they stand for: our parameters and the
    numbers are JSON numbers (``true``/``false`` for booleans), every other field a string."""
    body = dict(query)
    for name, text in body.items():
        p = EXTRAS.get(name)
        if p is not None and p.type is bool:
            if text not in ("true", "false"):
                raise APIError(400, f"parameter {name} must be true or false, got {shown(text)}", name)
            body[name] = text == "true"
        elif p is not None or name in NUMBERS:
            if not JSON_NUMBER.fullmatch(text):
                raise APIError(400, f"{name} must be a number, got {shown(text)}", name)
            try:
                body[name] = json.loads(text)
            except ValueError:  # over 4,300 digits
                raise APIError(400, f"{name} must be a number, got {shown(text)}", name) from None
    return body


def check_string(name: str, value) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{name} must be a string, got {shown(described(value))}", name)
    if problem := surrogate_error(name, value):  # a lone surrogate ("\ud800" in JSON): no UTF-8 for it
        raise APIError(400, problem, name)
    return value


async def speech_request(body: dict, voices: Callable[[], Awaitable[list[dict]]]) -> dict:
    """OpenAI's body (plus our parameters) -> keyword arguments of ``AsyncTTSClient.stream``. ``null``
    means absent. ``voices``: the registered voices (fetched only for a voice other than ``default``)."""
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise APIError(400, f"unknown fields: {shown(unknown)}", unknown[0])
    for name in STRINGS:
        if name in body:
            check_string(name, body[name])
    voice = voice_field(body.get("voice", "default"))
    text = body.get("input")
    if text is None or not text.strip():
        raise APIError(400, "input must be a non-empty string", "input")
    if len(text) > MAX_TEXT_CHARS:  # the server's TEXT limit, told as this field
        raise APIError(400, f"input is {len(text)} characters; the limit is {MAX_TEXT_CHARS}", "input")
    fmt = body.get("response_format", "mp3")
    if fmt not in FORMATS:
        raise APIError(400, f"response_format must be one of {sorted(FORMATS)}, got {shown(fmt)}", "response_format")
    try:  # ours: the rate of the raw formats (gateway.rates)
        check_rate(fmt, described(body.get("sample_rate")))
    except ValueError as e:
        raise APIError(400, str(e), "sample_rate") from None
    if body.get("stream_format", "audio") not in STREAM_FORMATS:
        raise APIError(400, f"stream_format must be one of {list(STREAM_FORMATS)}", "stream_format")
    instruction = instruction_field(body.get("instructions") or None)  # "" is absent, as OpenAI treats it
    parameters = {}
    for name, p in EXTRAS.items():
        if name in body:
            try:  # the server's own check, so its messages; the value goes on as the client sent it
                p.parse(described(body[name]))
            except ValueError as e:
                raise APIError(400, str(e), name) from None
            parameters[name] = body[name]
    kw = {"text": text, "parameters": parameters, "language": body.get("language")}
    if "seed" in body:
        seed = body["seed"]
        if not is_seed(seed):
            raise APIError(400, seed_message(described(seed)), "seed")
        kw["seed"] = seed
    if voice != "default":
        try:
            names = {v["name"] for v in await voices()}
        except (TTSError, ConnectionError, TimeoutError) as e:
            raise from_tts_error(e) from None
        if voice in names:
            if instruction is not None:
                raise APIError(400, WITH_A_VOICE, "instructions")
            kw["voice_id"] = voice
        elif voice not in STOCK_VOICES:
            raise APIError(400, f"voice {voice!r} is not registered (GET /v1/audio/voices lists them)", "voice")
    if instruction is not None:
        kw["instruction"] = instruction  # a stock name or default is no real voice: design one
    return kw


def seed_message(value) -> str:
    """The 400 message for a ``seed`` that is not the server's SEED (:func:`serving.contract.is_seed`)."""
    lo, hi = SEED_RANGE
    return f"seed must be an integer in {lo}..{hi}, got {shown(value)}"


def voice_field(value) -> str:
    """``voice``: a name, or OpenAI's custom-voice form ``{"id": "<name>"}`` (the SDK's ``VoiceID``) -> the name."""
    if isinstance(value, dict):
        if set(value) != {"id"}:
            raise APIError(400, f'voice as an object is {{"id": "<voice name>"}}, got keys {shown(sorted(value))}',
                           "voice")  # fmt: skip
        value = value["id"]
    return check_string("voice", value)


WITH_A_VOICE = (
    "instructions design a new voice and cannot go with a registered voice: FireRedTTS3-Instruct's cloning "
    "takes no instruction. Drop instructions to speak in the voice, or send voice 'default' (or a stock name "
    "such as 'alloy') to design a voice from the instructions"
)


def instruction_field(value, field: str = "instructions", acoustic: bool = False) -> str | None:
    """``instructions`` checked as the server checks INSTRUCTION (``engine.instructions``; the acoustic
    edits' templates with ``acoustic``) -> the stripped text, or None when absent; 400 naming ``field``."""
    if value is None:
        return None
    check = instructions.check_acoustic_edit if acoustic else instructions.check_instruction
    try:
        return check(check_string(field, value), field)
    except ValueError as e:
        raise APIError(400, str(e), field) from None
