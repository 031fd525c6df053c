"""The ``tts`` model's request handling that does not need Triton: parsing and validating a request."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from engine import contract as C
from engine.generator import GenerationParams
from engine.text import language_tag

MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class TTSRequest:
    text: str
    language: str
    ref_audio: np.ndarray | None
    ref_sample_rate: int
    ref_text: str
    voice_id: str
    params: GenerationParams
    schedule: tuple[int, int]
    split_tokens: int = 80  # segment length limit for long texts; 0 = one segment


def parse_parameters(raw: str | dict | None) -> dict:
    """Request parameters (JSON text from Triton) -> typed values with defaults; unknown keys are errors."""
    given = json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})
    out = {}
    for key, (typ, default, _doc) in C.TTS_PARAMETERS.items():
        v = given.pop(key, default)
        try:
            out[key] = typ(v)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {key} must be {typ.__name__}, got {v!r}") from None
    if given:
        raise ValueError(f"unknown request parameters: {sorted(given)}; known: {sorted(C.TTS_PARAMETERS)}")
    for key in ("chunk_first", "chunk_next"):
        if not 1 <= out[key] <= 400:
            raise ValueError(f"parameter {key} must be in 1..400, got {out[key]}")
    if not 0 <= out["split_tokens"] <= 4096:
        raise ValueError(f"parameter split_tokens must be in 0..4096, got {out['split_tokens']}")
    return out


def build_request(
    text: str | None,
    language: str | None,
    ref_audio: np.ndarray | None,
    ref_sample_rate: int | None,
    ref_text: str | None,
    voice_id: str | None,
    seed: int | None,
    parameters: str | dict | None,
) -> TTSRequest:
    """Validate one request; every error names the field and what was wrong."""
    if text is None or not text.strip():
        raise ValueError("TEXT must be a non-empty string")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"TEXT is {len(text)} characters; the limit is {MAX_TEXT_CHARS} (split long texts)")
    language = language or "English"
    try:
        language_tag(language)
    except ValueError as e:
        raise ValueError(f"LANGUAGE: {e}") from None
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
    p = parse_parameters(parameters)
    try:
        gp = GenerationParams(
            seed=1234 if seed is None else int(seed), steps=p["steps"], cfg=p["cfg"], max_patches=p["max_patches"]
        )
    except ValueError as e:
        raise ValueError(f"bad generation parameter: {e}") from None
    return TTSRequest(
        text, language, ref_audio, int(ref_sample_rate or 0), ref_text or "", voice_id or "", gp,
        (p["chunk_first"], p["chunk_next"]), p["split_tokens"],
    )  # fmt: skip
