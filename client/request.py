"""One ``tts`` request, built once and encoded for gRPC (``InferInput`` tensors) or HTTP (JSON body).

Shared by the sync client (:mod:`client.tts_client`) and the asyncio one (:mod:`client.aio`), so both
protocols send exactly the same fields.
"""

from __future__ import annotations

import json

import numpy as np

SAMPLE_RATE = 24000  # Hz of the AUDIO output
PARAMETERS = ("steps", "cfg", "chunk_first", "chunk_next", "max_patches", "split_tokens")  # tts request parameters

# Triton input name -> (numpy dtype, Triton datatype) for the non-string inputs
_NUMERIC = {"REF_AUDIO": (np.float32, "FP32"), "REF_SAMPLE_RATE": (np.int32, "INT32"), "SEED": (np.int64, "INT64")}


class TTSError(RuntimeError):
    """The server rejected or failed the request; ``str(e)`` is the server's message."""


def request_fields(
    text: str,
    language: str | None = None,
    ref_audio: np.ndarray | None = None,
    ref_sample_rate: int | None = None,
    ref_text: str | None = None,
    voice_id: str | None = None,
    seed: int | None = None,
) -> dict:
    """Input name -> value for the inputs that are given (``None`` means: leave it to the server's default).

    ``ref_audio`` is mono float samples in [-1, 1], shape (n,), at ``ref_sample_rate`` Hz.
    """
    fields = {"TEXT": text, "LANGUAGE": language, "REF_TEXT": ref_text, "VOICE_ID": voice_id, "SEED": seed}
    if ref_audio is not None:
        fields["REF_AUDIO"] = np.asarray(ref_audio, np.float32).reshape(-1)
        fields["REF_SAMPLE_RATE"] = ref_sample_rate
    return {k: v for k, v in fields.items() if v is not None}


def grpc_inputs(fields: dict, tc=None) -> list:
    """``InferInput`` tensors of ``tc`` (default ``tritonclient.grpc``, also valid for its aio client;
    ``tritonclient.http`` works too). Strings become BYTES [1]."""
    if tc is None:
        import tritonclient.grpc as tc

    inputs = []
    for name, v in fields.items():
        if name in _NUMERIC:
            np_type, dt = _NUMERIC[name]
            arr = np.asarray(v, np_type).reshape(-1)
        else:
            arr, dt = np.array([str(v).encode("utf-8")], np.object_), "BYTES"
        t = tc.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def http_body(fields: dict, parameters: dict) -> str:
    """The JSON body of ``POST /v2/models/tts/generate_stream``."""
    body = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
    if parameters:
        body["parameters"] = parameters
    return json.dumps(body)


def http_error_text(raw: bytes) -> str:
    """The ``error`` of a Triton JSON error body, else the body as text."""
    try:
        return json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")


def grpc_error(error) -> Exception:
    """A ``tritonclient`` ``InferenceServerException`` or a ``grpc.RpcError`` -> the exception the client raises.

    Transport failures keep their meaning (``ConnectionError``, ``TimeoutError``); everything else is the
    server's verdict on the request (:class:`TTSError` with its message).
    """
    if hasattr(error, "code") and hasattr(error, "details"):  # grpc.RpcError (the aio call raises these)
        msg, status = error.details() or str(error.code()), str(error.code())
    else:
        msg = error.message() if hasattr(error, "message") else str(error)
        status = error.status() if hasattr(error, "status") else None
    if status == "StatusCode.UNAVAILABLE":
        return ConnectionError(f"server unavailable: {msg}")
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return TimeoutError(f"stream deadline exceeded: {msg}")
    return TTSError(msg)


def is_final(result) -> bool:
    """Whether a gRPC stream response is the request's last (``enable_empty_final_response``)."""
    return result.get_response().parameters["triton_final_response"].bool_param
