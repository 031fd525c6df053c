"""The protocol every process speaks: signal facts, error kinds, finish reasons, and the generator -> vocoder chunk.

Error kinds are carried in-band, as the first words of every error message and failure reason.
A status code cannot say whose fault an error is (docs/triton.md#T1). Every error is therefore tagged once where it arises (:func:`tagged`) and read once at each edge
(:func:`error_kind`: the client library, the OpenAI gateway).

Imports numpy only (nothing of torch, the text front end, serving or Triton): the client, the gateway
and every model process load this.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

# ---- signal facts of FireRedTTS3 (not configurable in the reference either) ----
SAMPLE_RATE = 24_000  # output and RedAE sample rate, Hz
LATENT_DIM = 64  # values per RedAE latent (one latent is 960 samples, 25 Hz)
MAX_REFERENCE_SECONDS = 60.0  # longest reference clip accepted for a voice prompt

# ---- error kinds ----
INVALID = "invalid: "  # bad input: the message names the field (INVALID_ARG, HTTP 400)
UNAVAILABLE = "unavailable: "  # busy, restarting, shutting down, a full table: retry shortly (HTTP 503)
ERROR = "error: "  # the server failed (INTERNAL, HTTP 500)
FORBIDDEN = "forbidden: "  # the admin key is missing or wrong (HTTP 403)
NOT_FOUND = "not found: "  # the named thing (a voice) does not exist (HTTP 404)
KINDS = (INVALID, UNAVAILABLE, ERROR, FORBIDDEN, NOT_FOUND)


def surrogate_error(field: str, text: str) -> str | None:
    """Why ``text`` cannot travel (every string crosses as UTF-8), naming ``field``; None when it can. JSON
    carries a lone surrogate (``"\\ud800"``), which has no UTF-8: refused by name where a message is parsed,
    rather than failing later as an encoding error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{field} must be valid Unicode text: it contains a lone surrogate at character {e.start}"
    return None


class Unavailable(Exception):
    """The server cannot serve this now (busy, restarting, a full table); the same request may succeed later."""


def error_kind(message: str) -> tuple[str, str]:
    """A server's error message -> (its tag, one of :data:`KINDS`; the message without it). A message
    without a tag (Triton's own, e.g. ``Request for unknown model``) is an :data:`ERROR`."""
    for tag in KINDS:
        if message.startswith(tag):
            return tag, message[len(tag) :]
    return ERROR, message


def tagged(exc: BaseException) -> str:
    """``exc`` as a tagged message: ValueError is bad input, :class:`Unavailable` a retry, the rest errors;
    a message that already carries a tag keeps it."""
    message = str(exc) or type(exc).__name__
    if message.startswith(KINDS):
        return message
    kind = INVALID if isinstance(exc, ValueError) else UNAVAILABLE if isinstance(exc, Unavailable) else ERROR
    return kind + message


# ---- finish reasons: why a stream (and so an utterance) ended; failures carry a tagged message instead ----
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


def failure_reason(exc: BaseException) -> str:
    """The finish reason that reports ``exc`` in a normal final response (see :func:`tagged`)."""
    return tagged(exc)


class StreamFailed(Exception):
    """A generator stream ended with a failure reason; ``kind`` says whose fault (``invalid``: the input)."""

    def __init__(self, reason: str):
        self.kind, message = error_kind(reason)  # a tag of KINDS
        self.invalid = self.kind == INVALID
        super().__init__(message)

    @property
    def reason(self) -> str:
        return f"{self.kind}{self}"


# ---- the generator -> vocoder chunk ----
@dataclass(frozen=True)
class Chunk:
    """One generator response, which is exactly one vocoder request (the protocol of both entry points).

    Attributes:
        stream_id: the generator stream (its correlation id); keys the vocoder's state.
        latents: (L, LATENT_DIM) float32 generated latents of this chunk (L may be 0 on the last chunk).
        prompt_latents: (4P, LATENT_DIM) float32 on a stream's first chunk (primes the vocoder),
            (0, LATENT_DIM) after.
        last: the stream ends with this chunk; the vocoder flushes and frees its state.
        finish_reason: with ``last``: stop | length | cancelled | a tagged failure ("invalid: ...",
            "unavailable: ...", "error: ..."); else "".
        seq: the chunk's index among its stream's audio chunks (0: the first, which carries the prompt
            latents and starts the vocoder's stream, even when they are empty).
        seal: the generator's MAC over the whole chunk (``serving.security.auth``), so that a vocoder reachable
            by anyone decodes only what the generator made, once and in order; 0 in-process.
        text: the text an Instruct stream wrote before it speaks (a voice design's plan, a semantic
            edit's new transcript), on its plan chunk: one that is not ``last`` and has no latents nor
            prompt latents (see :attr:`plan`); that chunk is for the client and never goes to the vocoder.
    """

    stream_id: int
    latents: np.ndarray
    prompt_latents: np.ndarray
    last: bool = False
    finish_reason: str = ""
    seq: int = 0
    seal: int = 0
    text: str = ""

    @property
    def failed(self) -> bool:
        return self.last and self.finish_reason.startswith(KINDS)

    @property
    def plan(self) -> bool:
        """The plan chunk of an Instruct stream: text only (every audio chunk before the last has latents)."""
        return not self.last and len(self.latents) == 0 and len(self.prompt_latents) == 0


def new_stream_id() -> int:
    """A stream's id, the one place ids are minted: 63 random bits, unguessable, never 0, far from Triton's own
    sequence ids; no MAC of its own (every chunk's seal covers it)."""
    return secrets.randbits(63) | 1


def end_chunk(stream_id: int, reason: str = CANCELLED) -> Chunk:
    """A last chunk with no latents: tells the vocoder to drop a stream's state without decoding."""
    empty = np.zeros((0, LATENT_DIM), np.float32)
    return Chunk(stream_id, empty, empty, True, reason)
