"""A request's inputs read off Triton's tensors, once: ``tts``'s (:func:`tts_inputs`) and a generator stream's
(:func:`stream_request`). ``pb`` is ``triton_python_backend_utils``, passed in: it only exists inside the stub."""

from __future__ import annotations

import numpy as np

from engine import instructions
from engine.frontend.language import detect_language
from serving import contract
from serving.intake.requests import ServedModels, TTSInputs
from serving.stub.triton_io import SPOKEN_TEXT_CHARS, get, latent_rows, scalar, string


def tts_inputs(pb, request, parameters: str | dict, text: str | None = None) -> TTSInputs:
    """A ``tts`` request's inputs, read once (``parse_request`` checks them); ``text``: what stands for TEXT (a
    text-in stream's, whose text comes in later pieces)."""
    return TTSInputs(
        text=string(pb, request, "TEXT", "") if text is None else text,
        language=string(pb, request, "LANGUAGE", ""),
        ref_audio=get(pb, request, "REF_AUDIO", required=False),
        ref_sample_rate=scalar(pb, request, "REF_SAMPLE_RATE", 0),
        ref_text=string(pb, request, "REF_TEXT", ""),
        voice_id=string(pb, request, "VOICE_ID", ""),
        seed=scalar(pb, request, "SEED", None),
        parameters=parameters,
        task=string(pb, request, "TASK", ""),
        instruction=string(pb, request, "INSTRUCTION", ""),
    )


def stream_request(pb, request, model, parameters: dict):
    """A generator request -> (tokens, VoicePrompt, GenerationParams, chunk schedule), or for an Instruct
    stream (InstructInput, GenerationParams, chunk schedule). ``parameters``: the request's, less the internal
    key and the pipe. Only ``tts`` and ``ensemble_generator`` reach the generator, and each checked its
    client's request: TEXT (after the front end), LANGUAGE, TASK and INSTRUCTION are taken as they come; checked
    here is what the generator itself needs: every tensor's size before any copy, and the model asked for."""
    task = string(pb, request, "TASK", "")
    ServedModels(tuple(model.models.cores)).check(task)
    settings = contract.decode_settings(scalar(pb, request, "SEED", None), parameters)
    rows = latent_rows(get(pb, request, "PROMPT_LATENTS"), "PROMPT_LATENTS", contract.MAX_PROMPT_LATENTS)
    if task:
        return _instruct_input(pb, request, model, task, rows), *settings
    text = _spoken_text(pb, request)
    language = string(pb, request, "LANGUAGE", "") or detect_language(text)
    speaker = get(pb, request, "SPEAKER").reshape(-1)
    if speaker.size != model.core.cfg.spk_in_dim:  # before any copy: a caller's size is never trusted
        raise ValueError(f"SPEAKER has {speaker.size} values; expected {model.core.cfg.spk_in_dim}")
    import torch

    from engine.prompt import VoicePrompt

    try:
        prompt = VoicePrompt(torch.from_numpy(rows.astype(np.float32)), torch.from_numpy(speaker.astype(np.float32)),
                             string(pb, request, "PROMPT_TEXT", ""))  # fmt: skip
    except ValueError as e:
        raise ValueError(f"PROMPT_LATENTS: {e}") from None
    return model.tokens(text, language, prompt), prompt, *settings


def _spoken_text(pb, request, field: str = "TEXT", default: str | None = None) -> str:
    """A text after the front end, bounded: numbers read out make it several times what the client sent."""
    text = string(pb, request, field, default)
    if len(text) > SPOKEN_TEXT_CHARS:
        raise ValueError(f"{field} is {len(text)} characters; the limit is {SPOKEN_TEXT_CHARS}")
    return text


def _instruct_input(pb, request, model, task: str, rows: np.ndarray):
    import torch

    instruction = string(pb, request, "INSTRUCTION", "")  # stripped and checked by tts (parse_request)
    text = _spoken_text(pb, request, default="").strip()  # Instruct's texts reach its ChatML stripped
    if task == instructions.DESIGN:
        if len(rows):
            raise ValueError(f"TASK {task} takes no PROMPT_LATENTS: it designs the voice")
        latents = None
    else:
        if not len(rows) or len(rows) % contract.PATCH_SIZE:
            raise ValueError(f"PROMPT_LATENTS must be whole patches of {contract.PATCH_SIZE} rows for TASK {task}")
        if task in instructions.EDITS and len(rows) > contract.MAX_EDIT_LATENTS:
            raise ValueError(f"the recording is longer than {instructions.MAX_EDIT_SECONDS:g} s (TASK {task})")
        latents = torch.from_numpy(rows.astype(np.float32))
        if not torch.isfinite(latents).all():
            raise ValueError("PROMPT_LATENTS has non-finite values")
    prompt_text = _spoken_text(pb, request, "PROMPT_TEXT", "").strip() if task == instructions.CLONE else ""
    return model.instruct_input(task, instruction, text, latents, prompt_text)
