"""Helpers shared by the ``model.py`` adapters (they run inside Triton's Python stub).

``pb`` is ``triton_python_backend_utils``, passed in because it only exists inside the stub.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np

from engine.frontend import detect_language
from engine.orchestrator import ERROR, INVALID, Chunk
from serving import contract as C
from serving.requests import MAX_TEXT_CHARS, check_language, check_text, generation_request

SPOKEN_TEXT_CHARS = 4 * MAX_TEXT_CHARS  # what the generator takes: a text after the front end


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    return logging.getLogger(name)


def model_parameters(args: dict) -> dict[str, str]:
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def checkpoint_path(params: dict[str, str]) -> str:
    path = params.get("checkpoint") or os.environ.get("FIRERED_CHECKPOINT", "")
    if not path:
        raise RuntimeError("no checkpoint: set the model parameter 'checkpoint' or $FIRERED_CHECKPOINT")
    return path


def load_tts(params: dict[str, str], parts: tuple[str, ...]):
    import torch

    from engine.pipeline import FireRedTTS3

    torch.set_num_threads(int(os.environ.get("TTS_TORCH_THREADS", "1")))
    return FireRedTTS3.from_checkpoint(checkpoint_path(params), device=params.get("device") or "cpu", parts=parts)


def get(pb, request, name: str, required: bool = True):
    """Input tensor as numpy (None when an optional input is absent)."""
    t = pb.get_input_tensor_by_name(request, name)
    if t is None:
        if required:
            raise ValueError(f"missing input {name}")
        return None
    return t.as_numpy()


_REQUIRED = object()


def scalar(pb, request, name: str, default=_REQUIRED):
    """First element of an input as a Python number; ``default`` when the input is absent (else an error)."""
    arr = get(pb, request, name, required=default is _REQUIRED)
    if arr is None:
        return default
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    return arr.reshape(-1)[0].item()


def string(pb, request, name: str, default: str | None = None) -> str | None:
    arr = get(pb, request, name, required=False)
    if arr is None or arr.size == 0:
        if default is None:
            raise ValueError(f"missing input {name}")
        return default
    try:
        return C.text_of(arr)
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not valid UTF-8") from None


def bytes_tensor(pb, name: str, text: str, batch: bool = True):
    arr = np.array([text.encode("utf-8")], dtype=np.object_)
    return pb.Tensor(name, arr.reshape(1, 1) if batch else arr)


def error_response(pb, message: str, invalid: bool = True, tagged: bool = False):
    """An error response. ``tagged``: the message starts with ``invalid: `` or ``error: `` too, for
    models called through BLS, where Triton 2.51 reports every error code as INTERNAL (the Python
    backend passes codes through only since python_backend #398): :func:`bls_error` reads the tag."""
    code = pb.TritonError.INVALID_ARG if invalid else pb.TritonError.INTERNAL
    if tagged:
        message = (INVALID if invalid else ERROR) + message
    return pb.InferenceResponse(error=pb.TritonError(message, code))


def bls_error(pb, model: str, response) -> Exception | None:
    """A BLS response's error as ValueError (the request was invalid) or RuntimeError, naming the model."""
    if not response.has_error():
        return None
    err = response.error()
    message = err.message()
    invalid = err.code() == pb.TritonError.INVALID_ARG or message.startswith(INVALID)
    message = message.removeprefix(INVALID).removeprefix(ERROR)
    return ValueError(message) if invalid else RuntimeError(f"{model}: {message}")


def tensors(pb, specs, values: dict, batch: bool = True) -> list:
    """``pb.Tensor`` of each spec named in ``values`` (with a leading batch dim of 1 if ``batch``)."""
    arrays = {s.name: s.array(values[s.name]) for s in specs if s.name in values}
    return [pb.Tensor(name, arr[None] if batch else arr) for name, arr in arrays.items()]


def chunk_tensors(pb, chunk, batch: bool = True) -> list:
    """A :class:`~engine.orchestrator.Chunk` as the generator's outputs, which are the vocoder's inputs."""
    values = {"STREAM_ID": chunk.stream_id, "LATENTS": chunk.latents, "PROMPT_LATENTS": chunk.prompt_latents,
              "LAST": chunk.last, "FINISH_REASON": chunk.finish_reason}  # fmt: skip
    return tensors(pb, C.GENERATOR_OUTPUTS, values, batch)


def read_chunk(tensor):
    """The generator's outputs or the vocoder's inputs -> Chunk; ``tensor(name)`` gives each as numpy."""

    def arr(name):
        value = tensor(name)
        if value is None:
            raise ValueError(f"missing {name}")
        return value

    return Chunk(
        stream_id=int(arr("STREAM_ID").reshape(-1)[0]),
        latents=arr("LATENTS").reshape(-1, C.LATENT_DIM),
        prompt_latents=arr("PROMPT_LATENTS").reshape(-1, C.LATENT_DIM),
        last=bool(arr("LAST").reshape(-1)[0]),
        finish_reason=C.text_of(arr("FINISH_REASON")),
    )


def stream_request(pb, request, tts, parameters: str | dict | None = None):
    """A generator request -> (tokens, VoicePrompt, GenerationParams, chunk schedule); ValueError naming
    the input for bad input. ``parameters``: the request's, if already read (default: all of them).
    TEXT is spoken as given: tts and tts_ensemble's prompt_encoder have run the front end on it. Used by
    the generator model (and the benchmark's engine-thread variant)."""
    import torch

    from engine.prompt import VoicePrompt

    # normalized text: numbers read out make it several times what the client sent ("2024" -> "twenty
    # twenty four"); the client's own text was held to MAX_TEXT_CHARS before the front end
    text = check_text(string(pb, request, "TEXT"), limit=SPOKEN_TEXT_CHARS)
    language = check_language(string(pb, request, "LANGUAGE", "")) or detect_language(text)
    given = request.parameters() if parameters is None else parameters
    params, schedule = generation_request(scalar(pb, request, "SEED", None), given)
    latents = get(pb, request, "PROMPT_LATENTS").astype(np.float32)
    if latents.size % C.LATENT_DIM:
        raise ValueError(f"PROMPT_LATENTS must have {C.LATENT_DIM} values per row, got shape {latents.shape}")
    speaker = get(pb, request, "SPEAKER").reshape(-1).astype(np.float32)
    text_of_prompt = string(pb, request, "PROMPT_TEXT", "")
    try:
        latents_t = torch.from_numpy(latents.reshape(-1, C.LATENT_DIM))
        prompt = VoicePrompt(latents_t, torch.from_numpy(speaker), text_of_prompt)
    except ValueError as e:
        raise ValueError(f"PROMPT_LATENTS: {e}") from None
    return tts.tokens(text, language, prompt), prompt, params, schedule
