"""The gateway's errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the one
place where the server's error kinds (its in-band tags, read by the client) become HTTP statuses."""

from __future__ import annotations

import json
import logging
import time

from fastapi.responses import Response

from client.request import TTSError
from engine.protocol import ERROR, FORBIDDEN, INVALID, NOT_FOUND, UNAVAILABLE

# kind -> (status, OpenAI error type). OpenAI's SDKs retry 503 and never 400: whatever makes the server
# busy or restarting must be a 503.
STATUSES = {
    INVALID: (400, "invalid_request_error"),
    UNAVAILABLE: (503, "service_unavailable"),
    ERROR: (500, "server_error"),
    FORBIDDEN: (403, "permission_error"),
    NOT_FOUND: (404, "not_found_error"),
}
UNAVAILABLE_TYPE = STATUSES[UNAVAILABLE][1]  # also what an unreachable server is
# What a client reads when Triton does not answer: the launcher starts the gateway with tritonserver, which
# takes 5 to 90 s to load its models, and the supervisor restarts it after an incident. The transport's
# own words ("failed to connect to all addresses; ... Connection refused") go to the gateway's log.
STARTING = "server starting, retry shortly"
RETRY_AFTER_SECONDS = 1
log = logging.getLogger("gateway")
LOG_EVERY_SECONDS = 10.0
_logged = [-LOG_EVERY_SECONDS]  # when the last one was logged (time.monotonic)


class APIError(Exception):
    """An error answer. ``param``: the request field at fault (OpenAI's ``param``), if one is."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
        close: bool = False, headers: dict[str, str] | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.close = close  # end the connection after answering (the rest of the request body is unwanted)
        self.headers = dict(headers or {})  # more headers of the answer (Allow for a 405)

    def response(self, body: dict | None = None) -> Response:
        """The answer; ``body``: a dialect's shape of this error (gateway.dialects), OpenAI's by default."""
        if body is None:
            body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        headers = {**self.headers, **({"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 503 else {})}
        if self.close:
            headers["Connection"] = "close"
        # ASCII JSON: a field name or value sent with a lone surrogate ("\ud800") cannot be encoded as UTF-8
        content = json.dumps(body).encode()
        return Response(content, status_code=self.status, headers=headers, media_type="application/json")


def from_tts_error(e: Exception, param: str | None = None) -> APIError:
    """What the client raised (a :class:`TTSError` of the server's kind, ``ConnectionError``,
    ``TimeoutError``) -> the answer; ``param``: the field the request's subject came in."""
    if isinstance(e, TTSError):
        status, kind = STATUSES[e.kind]
        return APIError(status, str(e), param if status in (400, 404) else None, kind)
    if isinstance(e, ConnectionError):
        now = time.monotonic()
        if now - _logged[0] >= LOG_EVERY_SECONDS:  # a start-up window would log every request otherwise
            _logged[0] = now
            log.warning("the TTS server does not answer (said at most every %g s): %s", LOG_EVERY_SECONDS, e)
        return APIError(503, STARTING, kind=UNAVAILABLE_TYPE)
    if isinstance(e, TimeoutError):
        return APIError(504, str(e), kind="timeout")
    raise TypeError(f"not an error of the TTS client: {e!r}")


def from_http_error(status: int, message: str, headers: dict[str, str] | None = None) -> APIError:
    """An error the web framework raised itself (a multipart body with too many fields, an unknown route or
    method, a body that does not validate) -> the same answer in OpenAI's shape."""
    kind = {404: "not_found_error"}.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return APIError(status, message, kind=kind, headers=headers)
