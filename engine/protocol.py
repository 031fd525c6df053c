"""Error kinds, carried in-band: the first words of every error message and failure reason.

Triton 2.51's HTTP ``generate`` answers every model error with 400, BLS reports every code as INTERNAL,
and a gRPC stream error has a message but no code, so a status code cannot say whose fault an error
is. Every error is therefore tagged once where it arises (:func:`tagged`) and read once at each edge
(:func:`error_kind`: the client library, the OpenAI gateway). No imports: every process loads this.
"""

from __future__ import annotations

INVALID = "invalid: "  # bad input: the message names the field (INVALID_ARG, HTTP 400)
UNAVAILABLE = "unavailable: "  # busy, restarting, shutting down, a full table: retry shortly (HTTP 503)
ERROR = "error: "  # the server failed (INTERNAL, HTTP 500)
FORBIDDEN = "forbidden: "  # the admin key is missing or wrong (HTTP 403)
NOT_FOUND = "not found: "  # the named thing (a voice) does not exist (HTTP 404)
KINDS = (INVALID, UNAVAILABLE, ERROR, FORBIDDEN, NOT_FOUND)


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
