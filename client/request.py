"""One ``tts`` request, built once and encoded for gRPC (``InferInput`` tensors) or HTTP (JSON body).

Shared by the sync client (:mod:`client.tts_client`) and the asyncio one (:mod:`client.aio`), so both
protocols send exactly the same fields.
"""

from __future__ import annotations

import json
import secrets

import numpy as np

from engine.orchestrator import ERROR, INVALID
from serving.contract import SAMPLE_RATE, TTS_PARAMETERS, input_spec  # noqa: F401 (SAMPLE_RATE: re-exported)

PARAMETERS = tuple(p.name for p in TTS_PARAMETERS)  # tts request parameters, as the CLI offers them


class TTSError(RuntimeError):
    """The server rejected or failed the request; ``str(e)`` is the server's message."""


class ServerBusy(TTSError):
    """The server's queue is full (it refused the request at once): retry after a short wait."""


def server_error(message: str) -> TTSError:
    return (ServerBusy if message.startswith("server busy") else TTSError)(message)


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


def sequence(model: str) -> dict:
    """Keyword arguments of ``async_stream_infer`` for ``model``. ``tts_ensemble`` runs the generator, a
    sequence model: it gets a random 63-bit sequence id, never Triton's own sequential ones, since a
    START on a live id takes the sequence over (the server refuses ensemble requests without one)."""
    if model != "tts_ensemble":
        return {}
    return {"sequence_id": secrets.randbits(63) | (1 << 62), "sequence_start": True}


def grpc_inputs(fields: dict, tc=None, model: str = "tts") -> list:
    """``InferInput`` tensors of ``tc`` (default ``tritonclient.grpc``, also valid for its aio client;
    ``tritonclient.http`` works too), typed and shaped as ``model``'s inputs in the serving contract."""
    if tc is None:
        import tritonclient.grpc as tc

    inputs = []
    for name, value in fields.items():
        spec = input_spec(model, name)
        arr = spec.array(value)
        t = tc.InferInput(name, list(arr.shape), spec.datatype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def http_body(fields: dict, parameters: dict) -> str:
    """The JSON body of ``POST /v2/models/{model}/generate_stream``: plain JSON values and flat lists
    (Triton shapes them as the model's inputs, the ensemble's ``[1, -1]`` included)."""
    body = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
    if parameters:
        body["parameters"] = parameters
    return json.dumps(body)


def http_error_text(raw: bytes) -> str:
    """The ``error`` of a Triton JSON error body (or of its one SSE event), else the body as text."""
    try:
        return json.loads(raw.strip().removeprefix(b"data:"))["error"]
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
    return server_error(msg)


def raise_if_failed(finish_reason) -> None:
    """``tts_ensemble`` reports a failed stream in FINISH_REASON ("invalid: ..." or "error: ...") of a
    normal last response, since an ensemble cannot end a stream with an error: raise it as one."""
    if finish_reason is None:
        return
    if isinstance(finish_reason, np.ndarray):
        if not finish_reason.size:
            return
        finish_reason = finish_reason.reshape(-1)[0]
    if isinstance(finish_reason, bytes):
        finish_reason = finish_reason.decode("utf-8", "replace")
    for prefix in (INVALID, ERROR):
        if finish_reason.startswith(prefix):
            raise TTSError(finish_reason.removeprefix(prefix))


def is_final(result) -> bool:
    """Whether a gRPC stream response is the request's last (``enable_empty_final_response``)."""
    return result.get_response().parameters["triton_final_response"].bool_param
