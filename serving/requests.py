"""Parsing and validating what clients send, without Triton: the ``tts`` request and a generator stream.

Every error is a ValueError that names the input or parameter as the client spelled it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from engine.orchestrator import Utterance
from engine.params import GENERATION_PARAMETERS, Parameter, generation_params, parse_parameters
from engine.text import language_tag
from serving.contract import TTS_PARAMETERS

MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class Voice:
    """The voice a request asks for: a reference clip, a registered name, or neither (silent prompt)."""

    ref_audio: np.ndarray | None = None  # (n,) float32 in [-1, 1]
    ref_sample_rate: int = 0
    ref_text: str = ""
    voice_id: str = ""


def request_parameters(raw: str | dict | None, known: tuple[Parameter, ...] = TTS_PARAMETERS) -> dict:
    """Triton's request parameters (JSON text in the Python backend) -> typed values with defaults."""
    try:
        given = json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})
    except ValueError:
        raise ValueError("request parameters are not valid JSON") from None
    return parse_parameters(given, known)


def check_language(language: str | None, field: str = "LANGUAGE") -> str:
    language = language or "English"
    try:
        language_tag(language)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return language


def check_text(text: str | None, field: str = "TEXT") -> str:
    if text is None or not text.strip():
        raise ValueError(f"{field} must be a non-empty string")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"{field} is {len(text)} characters; the limit is {MAX_TEXT_CHARS} (split long texts)")
    return text


def build_request(
    text: str | None,
    language: str | None,
    ref_audio: np.ndarray | None,
    ref_sample_rate: int | None,
    ref_text: str | None,
    voice_id: str | None,
    seed: int | None,
    parameters: str | dict | None,
) -> tuple[Utterance, Voice]:
    """Validate one ``tts`` request -> what to say and in which voice."""
    text = check_text(text)
    language = check_language(language)
    if ref_audio is not None:
        ref_audio = np.asarray(ref_audio, dtype=np.float32).reshape(-1)
        if ref_audio.size == 0:
            raise ValueError("REF_AUDIO is empty")
        if not ref_sample_rate:
            raise ValueError("REF_SAMPLE_RATE is required with REF_AUDIO")
        if voice_id:
            raise ValueError("give either REF_AUDIO or VOICE_ID, not both")
    elif ref_text:
        raise ValueError("REF_TEXT was given without REF_AUDIO")
    values = request_parameters(parameters)
    params, schedule = generation_params(seed, values)
    utterance = Utterance(text, language, params, schedule, values["split_tokens"])
    return utterance, Voice(ref_audio, int(ref_sample_rate or 0), ref_text or "", voice_id or "")


def generation_request(seed: int | None, parameters: str | dict | None):
    """A generator stream's seed and request parameters -> (GenerationParams, chunk schedule)."""
    return generation_params(seed, request_parameters(parameters, GENERATION_PARAMETERS))
