"""One ``tts`` request, built once and encoded for gRPC (``InferInput`` tensors) or HTTP (JSON body), and
what a response carries back (:class:`Chunk`, :func:`chunk_of`, failures by kind).

Shared by the sync client (:mod:`client.tts_client`), the asyncio one (:mod:`client.aio`) and text-in
streams (:mod:`client.text_in`, whose request layout is :func:`piece_request`), so every path sends exactly
the same fields and reads responses the same way; none of them imports another for these pieces.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np

from engine.protocol import ERROR, FORBIDDEN, INVALID, KINDS, NOT_FOUND, UNAVAILABLE, error_kind, surrogate_error
from serving.contract import ACOUSTIC_EDIT, SEMANTIC_EDIT, input_spec

EDIT_KINDS = {"semantic": SEMANTIC_EDIT, "acoustic": ACOUSTIC_EDIT}  # what a client calls an edit -> its TASK


class TTSError(RuntimeError):
    """The server refused or failed the request; ``str(e)`` is its message without the kind tag, ``kind``
    the tag (``engine.protocol.KINDS``). A plain ``TTSError`` is ``error``: the server failed."""

    kind = ERROR


class InvalidRequest(TTSError):
    """The request was bad; the message names the input or parameter. Retrying it will not help."""

    kind = INVALID


class ServerBusy(TTSError):
    """The server cannot take the request now (queue full, restarting, shutting down): retry shortly."""

    kind = UNAVAILABLE


ServerUnavailable = ServerBusy


class Forbidden(TTSError):
    """The admin key is missing or wrong."""

    kind = FORBIDDEN


class NotFound(TTSError):
    """What the request names does not exist (e.g. removing a voice that is not registered)."""

    kind = NOT_FOUND


ERRORS = {cls.kind: cls for cls in (InvalidRequest, ServerBusy, TTSError, Forbidden, NotFound)}  # one per kind


def server_error(message: str) -> TTSError:
    """A server's error message -> the exception of its kind, with the message after the tag.

    Triton's own messages carry no tag (an unknown or unloaded model, a request it rejects before a model
    sees it): they are a plain :class:`TTSError`, the server failing. Their wording is never read: it is
    Triton's, changes between releases, and says nothing the tag would not."""
    kind, text = error_kind(message)
    return ERRORS[kind](text)


class RequestSettings(TypedDict, total=False):
    """Every setting of one ``tts`` request but its text, all optional (absent or None: the server's default):
    the keywords of ``TTSClient.stream`` / ``synthesize`` / ``stream_text`` / ``edit`` and of
    ``AsyncTTSClient.stream`` / ``synthesize`` / ``open_text`` / ``stream_text`` / ``edit``, written once here."""

    language: str | None  # LANGUAGE: a language or dialect name; detected from the text when absent
    ref_audio: np.ndarray | None  # REF_AUDIO: (n,) mono float in [-1, 1] (an edit's: the recording to edit)
    ref_sample_rate: int | None  # REF_SAMPLE_RATE of ref_audio, in Hz
    ref_text: str | None  # REF_TEXT: the transcript of ref_audio
    voice_id: str | None  # VOICE_ID: a registered voice (instead of ref_audio)
    seed: int | None  # SEED
    parameters: dict | None  # the request parameters (serving.contract.TTS_PARAMETERS: steps, cfg, ...)
    instruction: str | None  # INSTRUCTION (FireRedTTS3-Instruct): with no voice, designs one
    task: str | None  # TASK: ``clone`` for Instruct cloning, the edits' (see edit_task)
    on_plan: Callable[[str], None] | None  # called with PLAN_TEXT (a design's plan, an edit's new transcript)
    speed: float | None  # the ``speed`` parameter, as a keyword (1.0: as the model speaks)


SETTINGS = tuple(RequestSettings.__annotations__)
# setting -> the input it fills (ref_audio and ref_sample_rate go together, below)
INPUTS = {"language": "LANGUAGE", "ref_text": "REF_TEXT", "voice_id": "VOICE_ID", "seed": "SEED",
          "instruction": "INSTRUCTION", "task": "TASK"}  # fmt: skip


@dataclass(frozen=True)
class TTSRequest:
    """One ``tts`` request as every client sends it (:meth:`of`): gRPC and HTTP, sync and asyncio, one
    request or a text-in stream's first."""

    fields: dict  # input name -> value, the given ones (grpc_inputs, http_body)
    parameters: dict  # the request parameters, speed included
    on_plan: Callable[[str], None] | None = None

    @classmethod
    def of(cls, text: str | None, settings: Mapping) -> TTSRequest:
        """``text`` (None: none, as for the edits and text-in streams) and :class:`RequestSettings`; a
        TypeError names a keyword that is not one, as Python does for a function's."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}; the request settings are {', '.join(SETTINGS)}"
            )
        fields = {"TEXT": text} | {name: settings.get(key) for key, name in INPUTS.items()}
        if settings.get("ref_audio") is not None:
            fields["REF_AUDIO"] = np.asarray(settings["ref_audio"], np.float32).reshape(-1)
            fields["REF_SAMPLE_RATE"] = settings.get("ref_sample_rate")
        fields = {k: v for k, v in fields.items() if v is not None}
        return cls(fields, with_speed(settings.get("parameters"), settings.get("speed")), settings.get("on_plan"))


def request_fields(text: str | None, **settings: Unpack[RequestSettings]) -> dict:
    """Input name -> value for the inputs that are given (``None`` means: leave it to the server's default)."""
    return TTSRequest.of(text, settings).fields


def with_speed(parameters: dict | None, speed: float | None) -> dict:
    """The request parameters with ``speed`` (the keyword) among them; ValueError when both say one."""
    parameters = dict(parameters or {})
    if speed is not None:
        if "speed" in parameters and parameters["speed"] != speed:
            raise ValueError(f"speed={speed} and parameters['speed']={parameters['speed']} disagree: give one")
        parameters["speed"] = speed
    return parameters


def check_unicode(fields: dict) -> None:
    """ValueError naming the first string input that is not valid Unicode (a lone surrogate such as
    ``"\\ud800"``, which JSON gives Python and which has no UTF-8): refused here, by name, rather than
    failing in the encoder (gRPC) or reaching the server (HTTP's JSON can carry it)."""
    for name, value in fields.items():
        if isinstance(value, str) and (problem := surrogate_error(name, value)):
            raise ValueError(problem)


def grpc_inputs(fields: dict, tc=None, model: str = "tts") -> list:
    """``InferInput`` tensors of ``tc`` (default ``tritonclient.grpc``, also valid for its aio client;
    ``tritonclient.http`` works too), typed and shaped as ``model``'s inputs in the serving contract.
    ValueError naming the input for a string that is not valid Unicode (:func:`check_unicode`)."""
    if tc is None:
        import tritonclient.grpc as tc

    check_unicode(fields)
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
    (Triton shapes them as the model's inputs, the ensemble's ``[1, -1]`` included). ValueError as
    :func:`grpc_inputs`'s."""
    check_unicode(fields)
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

    Transport failures keep their meaning: ``TimeoutError`` for a deadline, ``ConnectionError`` for an
    UNAVAILABLE status whose message has no kind tag (no server there, the connection broke); everything
    else is the server's verdict, mapped by its tag (:func:`server_error`).
    """
    if hasattr(error, "code") and hasattr(error, "details"):  # grpc.RpcError (the aio call raises these)
        msg, status = error.details() or str(error.code()), str(error.code())
    else:
        msg = error.message() if hasattr(error, "message") else str(error)
        status = error.status() if hasattr(error, "status") else None
    msg = msg or ""
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return TimeoutError(f"stream deadline exceeded: {msg}")
    if status == "StatusCode.UNAVAILABLE" and not msg.startswith(KINDS):
        return ConnectionError(f"server unavailable: {msg}")
    return server_error(msg)


def edit_task(kind: str) -> str:
    """``semantic`` or ``acoustic`` -> the TASK of that edit (ValueError for another kind)."""
    if kind not in EDIT_KINDS:
        raise ValueError(f"an edit is {' or '.join(EDIT_KINDS)}, got {kind!r}")
    return EDIT_KINDS[kind]


def plan_text(value) -> str | None:
    """A response's PLAN_TEXT (gRPC: a BYTES array; HTTP: a string or a list of one) -> str, or None
    where the response has none."""
    if value is None:
        return None
    if isinstance(value, np.ndarray | list):
        flat = np.asarray(value, dtype=object).reshape(-1)
        if not flat.size:
            return None
        value = flat[0]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def raise_if_failed(finish_reason) -> None:
    """``tts_ensemble`` reports a failed stream in FINISH_REASON (a kind tag and a message, e.g.
    "invalid: ...") of a normal last response, since an ensemble cannot end a stream with an error:
    raise it as one (:func:`server_error`)."""
    if finish_reason is None:
        return
    if isinstance(finish_reason, np.ndarray):
        if not finish_reason.size:
            return
        finish_reason = finish_reason.reshape(-1)[0]
    if isinstance(finish_reason, bytes):
        finish_reason = finish_reason.decode("utf-8", "replace")
    if finish_reason.startswith(KINDS):
        raise server_error(finish_reason)


def is_final(result) -> bool:
    """Whether a gRPC stream response is the request's last (``enable_empty_final_response``)."""
    return result.get_response().parameters["triton_final_response"].bool_param


@dataclass(frozen=True)
class Chunk:
    audio: np.ndarray  # (n,) float32 at 24 kHz
    arrival: float  # seconds since the request was sent


def chunk_of(result, on_plan, t0: float) -> Chunk | None:
    """One gRPC stream response -> its audio as a :class:`Chunk` (None when it carries none); a failure in
    its FINISH_REASON raised (:func:`raise_if_failed`); its plan text to ``on_plan``."""
    raise_if_failed(result.as_numpy("FINISH_REASON"))
    if on_plan is not None and (plan := plan_text(result.as_numpy("PLAN_TEXT"))) is not None:
        on_plan(plan)
    audio = result.as_numpy("AUDIO")
    if audio is None or not audio.size:
        return None
    return Chunk(audio.astype(np.float32).reshape(-1), time.perf_counter() - t0)


def sequence_id() -> int:
    """A random sequence id: another client cannot guess it (a START on a live id is refused)."""
    return secrets.randbits(63) | 1


def piece_request(model: str, sequence: int, text: str, flush: bool, start: bool = False, end: bool = False,
                  fields: dict | None = None, parameters: dict | None = None, tc=None) -> dict:  # fmt: skip
    """One request of a text-in stream, as ``stream_infer`` takes it (the first carries ``fields``: the
    voice, seed, ..., and the request ``parameters``)."""
    values = {**(fields or {}), "TEXT": text}
    if flush:
        values["FLUSH"] = True
    request = {"model_name": model, "inputs": grpc_inputs(values, tc, model=model), "sequence_id": sequence,
               "sequence_start": start, "sequence_end": end}  # fmt: skip
    if parameters:
        request["parameters"] = parameters
    return request
