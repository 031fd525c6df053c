"""What opens a context on an agent socket, in the core's terms (:mod:`gateway.text_socket`), whatever the
vendor: a dialect reads its own fields into :class:`Options`, and :func:`stream_fields` makes of them the
fields of ``AsyncTTSClient.open_text`` (voices named as the speech route names them). A malformed message is
a :class:`ProtocolError` naming the field, with its context when that was readable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.fields import STOCK_VOICES, WITH_A_VOICE


class ProtocolError(ValueError):
    """A message the server cannot take: ``field`` names the part, ``context_id`` is its context (or None)."""

    def __init__(self, message: str, field: str, context_id: str | None = None):
        super().__init__(message)
        self.field, self.context_id = field, context_id


class Output(Protocol):
    """A context's encoder: float32 24 kHz chunks -> the bytes its replies carry."""

    def push(self, audio: np.ndarray) -> bytes: ...
    def finish(self) -> bytes: ...


@dataclass(frozen=True)
class Options:
    """A context's options, from the message that opens it (they hold for the context)."""

    voice_id: str  # a registered voice's name, a stock voice, or "default"
    language: str | None  # the model's name for it (None: detect)
    output: Callable[[], Output]  # makes the context's encoder
    timestamps: bool = False  # timings of its units wanted
    speed: float | None = None  # our speed parameter (time-stretched, same pitch)
    # extensions (docs/agents.md): Instruct's voice design, our seed and utterance parameters
    instructions: str | None = None  # a voice description: designs a voice (with a stock voice or default)
    seed: int | None = None
    parameters: dict | None = None  # engine.params.UTTERANCE_PARAMETERS by name, as /v1/audio/speech takes them


async def stream_fields(options: Options, voices: Callable[[], Awaitable[list[dict]]], context_id: str) -> dict:
    """``options`` -> the fields of ``AsyncTTSClient.open_text``; :class:`ProtocolError` for an unknown voice."""
    out = {"language": options.language}
    for name in ("seed", "speed", "parameters"):
        if getattr(options, name) is not None:
            out[name] = getattr(options, name)
    voice = options.voice_id
    if voice != "default":
        if voice in {v["name"] for v in await voices()}:
            if options.instructions is not None:
                raise ProtocolError(WITH_A_VOICE, "instructions", context_id)
            out["voice_id"] = voice
        elif voice not in STOCK_VOICES:
            message = f"voice {voice!r} is not registered (GET /v1/audio/voices lists them)"
            raise ProtocolError(message, "voice", context_id)
    if options.instructions is not None:
        out["instruction"] = options.instructions
    return out
