"""Helpers shared by the ``model.py`` adapters (they run inside Triton's Python stub).

``pb`` is ``triton_python_backend_utils``, passed in because it only exists inside the stub.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np

from engine import contract as C


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


def scalar(pb, request, name: str, default=None):
    arr = get(pb, request, name, required=default is None)
    return default if arr is None else arr.reshape(-1)[0].item()


def string(pb, request, name: str, default: str | None = None) -> str | None:
    arr = get(pb, request, name, required=False)
    if arr is None or arr.size == 0:
        if default is None:
            raise ValueError(f"missing input {name}")
        return default
    return C.text_of(arr)


def bytes_tensor(pb, name: str, text: str, batch: bool = True):
    arr = np.array([text.encode("utf-8")], dtype=np.object_)
    return pb.Tensor(name, arr.reshape(1, 1) if batch else arr)


def error_response(pb, message: str, invalid: bool = True):
    code = pb.TritonError.INVALID_ARG if invalid else pb.TritonError.INTERNAL
    return pb.InferenceResponse(error=pb.TritonError(message, code))


def generator_inputs(pb, tokens, prompt_latents, speaker, params, schedule) -> list:
    """The generator's input tensors (engine.contract.GENERATOR_INPUTS), each with a batch dim of 1."""

    def one(name, value, dtype):
        return pb.Tensor(name, np.array([[value]], dtype))

    return [
        pb.Tensor("TOKENS", np.asarray(tokens, np.int64)[None]),
        pb.Tensor("PROMPT_LATENTS", prompt_latents),
        pb.Tensor("SPEAKER", speaker),
        one("SEED", params.seed, np.int64),
        one("STEPS", params.steps, np.int32),
        one("CFG", params.cfg, np.float32),
        one("MAX_PATCHES", params.max_patches, np.int32),
        one("CHUNK_FIRST", schedule[0], np.int32),
        one("CHUNK_NEXT", schedule[-1], np.int32),
    ]
