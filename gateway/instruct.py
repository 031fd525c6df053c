"""FireRedTTS3-Instruct through the gateway: a voice designed once from a description and registered as a
named voice (``POST /v1/audio/voices`` with ``instructions`` and ``text`` instead of a file), and
``POST /v1/audio/edits``, which streams a recording edited as an instruction says (semantic: its words;
acoustic: its speed, pitch or volume). Every malformed field is a 400 naming it, before the server is asked.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

import numpy as np
from fastapi import FastAPI, Request

from client.aio import AsyncTTSClient
from client.request import EDIT_KINDS, TTSError
from client.voices import VoiceClient
from engine.config import PATCH_SAMPLES
from engine.instructions import MAX_EDIT_SECONDS
from engine.params import shown
from engine.protocol import MAX_REFERENCE_SECONDS, SAMPLE_RATE
from gateway.body import MAX_UPLOAD_BYTES, read_capped, uploaded_audio
from gateway.encode import FORMATS
from gateway.errors import APIError, from_tts_error
from gateway.fields import EXTRAS, STREAM_FORMATS, check_string, from_query, instruction_field, seed_message
from gateway.streaming import stream_response
from serving.contract import VOICE_NAME, is_seed

MAX_SAMPLE_CHARS = 300  # the sample sentence a designed voice speaks once, to become its reference
# The sample is one segment cut at the longest reference the voices model keeps (375 patches of 160 ms).
MAX_SAMPLE_PATCHES = int(MAX_REFERENCE_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES
DESIGN_FIELDS = {"name", "instructions", "text", "language", "seed", "max_patches"}
EDIT_FIELDS = {"model", "file", "instructions", "type", "response_format", "stream_format", "seed", *EXTRAS}
INTEGER = re.compile(r"-?[0-9]{1,19}")


def seed_field(value) -> int | None:
    """A form's or JSON body's ``seed`` -> int64, None when absent; 400 naming ``seed``."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and INTEGER.fullmatch(value):
        value = int(value)
    if not is_seed(value):
        raise APIError(400, seed_message(value), "seed")
    return value


def check_fields(fields: Mapping, known: set[str]) -> None:
    unknown = sorted(set(fields) - known)
    if unknown:
        raise APIError(400, f"unknown fields: {shown(unknown)}; known: {sorted(known)}", unknown[0])


async def design_voice(tts: AsyncTTSClient, voices: VoiceClient, fields: Mapping) -> dict:
    """Design a voice from ``fields["instructions"]`` speaking ``fields["text"]`` once, and register that
    audio as the voice ``fields["name"]`` (its transcript: the text) -> the voice as the voices model
    returns it, plus ``plan``: the voice attributes the model worked out."""
    check_fields(fields, DESIGN_FIELDS)
    name = fields.get("name")
    if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):  # the voices model's rule, checked first
        raise APIError(400, f"name must match {VOICE_NAME.pattern}, got {shown(name)}", "name")
    instruction = instruction_field(fields.get("instructions"))
    if instruction is None:
        raise APIError(400, "instructions (the voice description) are required to design a voice", "instructions")
    text = fields.get("text")
    if text is None or not check_string("text", text).strip():
        raise APIError(400, "text (a sentence for the designed voice to speak) is required", "text")
    if len(text) > MAX_SAMPLE_CHARS:
        raise APIError(400, f"text is {len(text)} characters; a sample sentence is at most {MAX_SAMPLE_CHARS}", "text")
    language = fields.get("language")
    if language is not None:
        check_string("language", language)
    patches = fields.get("max_patches", MAX_SAMPLE_PATCHES)
    if isinstance(patches, str) and INTEGER.fullmatch(patches):
        patches = int(patches)
    if isinstance(patches, bool) or not isinstance(patches, int) or not 1 <= patches <= MAX_SAMPLE_PATCHES:
        message = (
            f"max_patches must be an integer in 1..{MAX_SAMPLE_PATCHES} (a reference's 60 s), got {shown(patches)}"
        )
        raise APIError(400, message, "max_patches")
    seed = seed_field(fields.get("seed"))
    plans: list[str] = []
    try:  # one segment: the sample is one take of the voice
        await asyncio.to_thread(voices.check_key)  # the admin's key first: nobody else's design runs
        audio = await tts.synthesize(text, instruction=instruction, language=language, seed=seed,
                                     parameters={"split_tokens": 0, "max_patches": patches},
                                     on_plan=plans.append)  # fmt: skip
        if not audio.size:
            raise APIError(
                502, "the designed voice came back with no audio; try another text or seed", kind="server_error"
            )
        # what a downloaded file of it would hold: the voices model refuses peaks far beyond full scale
        audio = np.clip(audio, -1.0, 1.0)
        voice = await asyncio.to_thread(voices.add, name, audio, SAMPLE_RATE, text)
    except (TTSError, ConnectionError, TimeoutError) as e:
        raise from_tts_error(e) from None
    return {**voice, "plan": plans[0] if plans else None}


def add_edit_routes(app: FastAPI, tts: AsyncTTSClient, decoding: asyncio.Semaphore, body_timeout: float) -> None:
    """``POST /v1/audio/edits`` (multipart): ``file`` (the recording, at most 30 s), ``instructions``,
    ``type`` (``semantic`` or ``acoustic``), ``response_format``, ``stream_format``, ``seed`` and our
    parameters (``steps``, ``cfg``, ``max_patches``, ...: numbers as text, as in a query string)."""

    @app.post("/v1/audio/edits")
    async def edit(request: Request):
        too_big = f"the upload is over {MAX_UPLOAD_BYTES // 2**20} MB"
        await read_capped(request, MAX_UPLOAD_BYTES, too_big, body_timeout)
        form = await request.form()
        check_fields(form, EDIT_FIELDS)
        for name in EDIT_FIELDS - {"file"}:
            if name in form:
                check_string(name, form[name])
        kind = form.get("type")
        if kind not in EDIT_KINDS:
            raise APIError(400, f"type must be one of {sorted(EDIT_KINDS)}, got {shown(kind)}", "type")
        instruction = instruction_field(form.get("instructions") or None, acoustic=kind == "acoustic")
        if instruction is None:
            raise APIError(400, "instructions (what to change in the recording) are required", "instructions")
        fmt = form.get("response_format") or "mp3"
        if fmt not in FORMATS:
            raise APIError(
                400, f"response_format must be one of {sorted(FORMATS)}, got {shown(fmt)}", "response_format"
            )
        stream_format = form.get("stream_format") or "audio"
        if stream_format not in STREAM_FORMATS:
            raise APIError(400, f"stream_format must be one of {list(STREAM_FORMATS)}", "stream_format")
        seed = seed_field(form.get("seed"))
        # our parameters (steps, cfg, max_patches, ...) as the GET form of speech takes them: text -> typed
        typed = from_query({name: form[name] for name in EXTRAS if name in form})
        parameters = {}
        for name, value in typed.items():
            try:
                EXTRAS[name].parse(value)
            except ValueError as e:
                raise APIError(400, str(e), name) from None
            parameters[name] = value
        audio, rate = await uploaded_audio(form.get("file"), decoding, "the recording to edit", request=request,
                                           seconds=MAX_EDIT_SECONDS, what="a recording to edit")  # fmt: skip
        kw = {"recording": audio, "sample_rate": rate, "instruction": instruction, "kind": kind, "seed": seed,
              "parameters": parameters}  # fmt: skip
        return await stream_response(tts.edit, kw, fmt, stream_format, None,
                                     request.app.state.budgets.bounds.unsent_seconds, request.scope,
                                     request.app.state.shares)  # fmt: skip
