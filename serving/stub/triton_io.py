"""Helpers shared by the ``model.py`` adapters. ``pb`` is ``triton_python_backend_utils``, passed in because
it only exists inside the stub."""

from __future__ import annotations

import logging
import os
import re
import sys
import time

import numpy as np

from engine.protocol import INVALID, KINDS, NOT_FOUND, UNAVAILABLE, Chunk, Unavailable, error_kind, tagged
from serving import contract

SPOKEN_TEXT_CHARS = 4 * contract.MAX_TEXT_CHARS  # what the generator takes: a text after the front end


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    return logging.getLogger(name)


class Throttled:
    """A warning that anyone can trigger (a refused request from outside): logged at most once per
    ``seconds``, with how many were left out, so that a flood of them cannot fill the disk."""

    def __init__(self, log: logging.Logger, seconds: float = 10.0):
        self.log, self.seconds, self.next, self.left_out = log, seconds, 0.0, 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self.next:
            self.left_out += 1
            return
        more = f" (and {self.left_out} more like it in the last {self.seconds:g} s)" if self.left_out else ""
        self.log.warning(message + more, *args)
        self.next, self.left_out = now + self.seconds, 0


def checkpoint_path(checkpoint: str) -> str:
    """A model's ``checkpoint`` option, or $FIRERED_CHECKPOINT when it is empty."""
    path = checkpoint or os.environ.get("FIRERED_CHECKPOINT", "")
    if not path:
        raise RuntimeError("no checkpoint: set the model parameter 'checkpoint' or $FIRERED_CHECKPOINT")
    return path


def load_model(options, parts: tuple[str, ...]):
    """The model's ``parts`` of FireRedTTS3 (``options``: serving.config.model_options, with ``checkpoint``)."""
    import torch

    from engine.fireredtts3 import FireRedTTS3
    from serving.intake.requests import parse_models

    torch.set_num_threads(int(os.environ.get("TTS_TORCH_THREADS", "1")))
    models = parse_models(getattr(options, "models", "")) or None  # None: the cores the folder holds
    return FireRedTTS3.from_checkpoint(checkpoint_path(options.checkpoint), device=options.device, parts=parts,
                                       models=models)  # fmt: skip


def get(pb, request, name: str, required: bool = True):
    """Input tensor as numpy (None when an optional input is absent)."""
    t = pb.get_input_tensor_by_name(request, name)
    if t is None and required:
        raise ValueError(f"missing input {name}")
    return None if t is None else t.as_numpy()


def scalar(pb, request, name: str, default):
    """First element of an input as a Python number; ``default`` when the input is absent."""
    arr = get(pb, request, name, required=False)
    if arr is not None and arr.size == 0:
        raise ValueError(f"{name} is empty")
    return default if arr is None else arr.reshape(-1)[0].item()


def string(pb, request, name: str, default: str | None = None) -> str | None:
    arr = get(pb, request, name, required=False)
    if arr is None or arr.size == 0:
        if default is None:
            raise ValueError(f"missing input {name}")
        return default
    try:
        return contract.text_of(arr)
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not valid UTF-8") from None


# The generator's secret model name (serving.security.auth.Keys.generator_model), as Triton's own messages may carry it
# ("Stub process 'generator-<hex>_0_0' is not healthy."): no client may read it.
SECRET_NAME = re.compile(r"generator-[0-9a-f]{32}")
# Triton's untagged words for a request to a model whose stub has died (docs/triton.md#T15; the launcher
# restarts the server): the only sign of it a BLS caller gets, with code INTERNAL (docs/triton.md#T1).
STUB_DEAD = "is not healthy"


def error_response(pb, error: BaseException | str):
    """An error response whose message carries its kind (:func:`engine.protocol.tagged`: status codes do not
    survive Triton, docs/triton.md#T1); its status code follows the kind (gRPC unary calls see it)."""
    message = SECRET_NAME.sub("generator", tagged(error) if isinstance(error, BaseException) else error)
    kind = error_kind(message)[0]
    code = {INVALID: pb.TritonError.INVALID_ARG, UNAVAILABLE: pb.TritonError.UNAVAILABLE,
            NOT_FOUND: pb.TritonError.NOT_FOUND}.get(kind, pb.TritonError.INTERNAL)  # fmt: skip
    return pb.InferenceResponse(error=pb.TritonError(message, code))


def answer_each(pb, requests, answer, log: logging.Logger) -> list:
    """A plain ``execute``: ``answer(request)`` -> its response, for each request; what it raises -> its error
    response (ValueError and Unavailable keep their tags; anything else is logged)."""
    out = []
    for r in requests:
        try:
            out.append(answer(r))
        except (ValueError, Unavailable) as e:  # Refused and NOT_FOUND keep their own tags
            out.append(error_response(pb, e))
        except Exception as e:
            log.exception("%s request failed", log.name)
            out.append(error_response(pb, RuntimeError(f"{log.name}: {e}")))
    return out


def bls_error(pb, model: str, response) -> Exception | None:
    """A BLS response's error as the exception of its kind: ValueError (the request was invalid),
    :class:`~engine.protocol.Unavailable` (retry later) or RuntimeError naming the model."""
    if not response.has_error():
        return None
    error = response.error()
    text = SECRET_NAME.sub("generator", error.message())
    kind, message = error_kind(text)
    if not text.startswith(KINDS) and STUB_DEAD in text:
        return Unavailable(f"{model} backend is not healthy; the server restarts it, retry shortly")
    if not text.startswith(KINDS) and error.code() == pb.TritonError.UNAVAILABLE:
        kind = UNAVAILABLE  # Triton's own refusal, untagged (a full queue: "Exceeds maximum queue size")
    if kind == INVALID:
        return ValueError(message)
    if kind == UNAVAILABLE:
        return Unavailable(message)
    return RuntimeError(f"{model}: {message}")


def tensors(pb, specs, values: dict, batch: bool = True) -> list:
    """``pb.Tensor`` of each spec named in ``values`` (with a leading batch dim of 1 if ``batch``)."""
    arrays = {s.name: s.array(values[s.name]) for s in specs if s.name in values}
    return [pb.Tensor(name, arr[None] if batch else arr) for name, arr in arrays.items()]


def chunk_tensors(pb, chunk) -> list:
    """A :class:`~engine.protocol.Chunk` as ensemble_generator's outputs (the generator packs its own)."""
    values = {"STREAM_ID": chunk.stream_id, "LATENTS": chunk.latents, "PROMPT_LATENTS": chunk.prompt_latents,
              "LAST": chunk.last, "FINISH_REASON": chunk.finish_reason, "SEAL": (chunk.seq, chunk.seal),
              "TEXT": chunk.text}  # fmt: skip
    return tensors(pb, contract.GENERATOR_OUTPUTS, values)


def outputs(pb, response):
    """A BLS response's output tensors as ``tensor(name)`` -> numpy (None when absent)."""
    return lambda name: None if (t := pb.get_output_tensor_by_name(response, name)) is None else t.as_numpy()


def latent_rows(value: np.ndarray, name: str, most: int) -> np.ndarray:
    """``value`` as (rows, 64) latents, a view; ValueError naming ``name`` unless whole rows, at most ``most``
    (checked before anything is copied: no caller's size is trusted)."""
    if value.size % contract.LATENT_DIM:
        raise ValueError(f"{name} must have {contract.LATENT_DIM} values per row, got shape {value.shape}")
    if value.size // contract.LATENT_DIM > most:
        raise ValueError(f"{name} has {value.size // contract.LATENT_DIM} rows; at most {most}")
    return value.reshape(-1, contract.LATENT_DIM)


def read_chunk(tensor):
    """The vocoder's inputs, one chunk (``tensor(name)``: numpy) -> Chunk; ValueError naming the tensor for
    anything a generator never sends, checked before anything is copied or decoded."""

    def arr(name, size: int | None = None, rows: int | None = None):
        value = tensor(name)
        if value is None:
            raise ValueError(f"missing {name}")
        if size is not None and value.size != size:
            raise ValueError(f"{name} must have {size} value(s), got {value.size}")
        return value if rows is None else latent_rows(value, name, rows)

    seq, seal = (int(v) for v in arr("SEAL", 2).reshape(-1))
    return Chunk(
        stream_id=int(arr("STREAM_ID", 1).reshape(-1)[0]),
        latents=arr("LATENTS", rows=contract.MAX_CHUNK_LATENTS),
        prompt_latents=arr("PROMPT_LATENTS", rows=contract.MAX_PROMPT_LATENTS),
        last=bool(arr("LAST", 1).reshape(-1)[0]),
        finish_reason=contract.text_of(arr("FINISH_REASON", 1)),
        seq=seq,
        seal=seal,
    )
