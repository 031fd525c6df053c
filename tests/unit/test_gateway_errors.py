"""How the gateway turns the server's answers into OpenAI error statuses (no server needed): by the kind
tag the message starts with, never by its wording."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from client.request import grpc_error, http_error_text, raise_if_failed, server_error
from gateway.app import create_app
from gateway.errors import from_tts_error
from serving.supervision.triton_env import free_port


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


BUSY = "server busy: 16 requests are running or waiting (limit 16); retry shortly"


@pytest.mark.parametrize(
    ("error", "status", "kind", "message"),
    [
        # a model's error inside a gRPC stream carries only its message (Triton's stream protocol has no code)
        (InferenceServerException("invalid: TEXT: nothing to speak after cleaning"), 400, "invalid_request_error",
         "TEXT: nothing to speak after cleaning"),
        (InferenceServerException(f"unavailable: {BUSY}"), 503, "service_unavailable", BUSY),
        (InferenceServerException("unavailable: generator backend died; the server is restarting, retry shortly"),
         503, "service_unavailable", "generator backend died; the server is restarting, retry shortly"),
        (InferenceServerException("unavailable: server is shutting down"), 503, "service_unavailable",
         "server is shutting down"),
        (InferenceServerException("error: generator: step failed"), 500, "server_error", "generator: step failed"),
        (InferenceServerException("forbidden: adding and removing voices needs the admin key"), 403,
         "permission_error", "adding and removing voices needs the admin key"),
        (InferenceServerException("not found: voice 'x' is not registered"), 404, "not_found_error",
         "voice 'x' is not registered"),
        # untagged: Triton's own messages are the server failing, whatever words they use
        (InferenceServerException("Request for unknown model: 'tts' is not found"), 500, "server_error",
         "Request for unknown model: 'tts' is not found"),
        (InferenceServerException("Stub process 'tts_0_0' is not healthy."), 500, "server_error",
         "Stub process 'tts_0_0' is not healthy."),
        (InferenceServerException(BUSY), 500, "server_error", BUSY),  # the wording is not the kind
        (InferenceServerException("TEXT: invalid: nothing"), 500, "server_error", "TEXT: invalid: nothing"),
        # a non-streaming call (the voices model) carries a status too: the tag still decides
        (InferenceServerException("unavailable: the voice table is full", status="StatusCode.UNAVAILABLE"), 503,
         "service_unavailable", "the voice table is full"),
        (InferenceServerException("invalid: NAME: bad voice name", status="StatusCode.INVALID_ARGUMENT"), 400,
         "invalid_request_error", "NAME: bad voice name"),
        (_RpcError(grpc.StatusCode.INTERNAL, f"unavailable: {BUSY}"), 503, "service_unavailable", BUSY),
    ],
)  # fmt: skip
def test_server_answers_map_to_openai_statuses_by_their_tag(error, status, kind, message):
    api = from_tts_error(grpc_error(error))
    assert (api.status, api.kind, api.message) == (status, kind, message)
    response = api.response()
    assert response.status_code == status
    assert (response.headers.get("retry-after") == "1") == (status == 503)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (_RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), 503, "service_unavailable"),
        (InferenceServerException("Socket closed", status="StatusCode.UNAVAILABLE"), 503, "service_unavailable"),
        (_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "no chunk in 60 s"), 504, "timeout"),
    ],
)  # fmt: skip
def test_transport_failures_map_to_503_and_504(error, status, kind):
    e = grpc_error(error)
    assert isinstance(e, ConnectionError | TimeoutError)
    api = from_tts_error(e)
    assert (api.status, api.kind) == (status, kind)
    assert (api.response().headers.get("retry-after") == "1") == (status == 503)


def test_the_ensembles_finish_reason_and_http_errors_map_the_same():
    with pytest.raises(Exception) as failed:
        raise_if_failed(np.array([f"unavailable: {BUSY}".encode()], dtype=np.object_))
    assert (from_tts_error(failed.value).status, str(failed.value)) == (503, BUSY)
    # Triton's HTTP generate endpoints answer every model error with 400: only the tag tells
    e = server_error(http_error_text(b'{"error":"forbidden: adding and removing voices needs the admin key"}'))
    assert from_tts_error(e).status == 403


def test_the_subject_of_a_request_is_its_param():
    missing = from_tts_error(server_error("not found: voice 'gone' is not registered"), "name")
    assert (missing.status, missing.param) == (404, "name")
    assert from_tts_error(server_error(f"unavailable: {BUSY}"), "name").param is None  # not the field's fault


@pytest.fixture(scope="module")
def unreachable():
    """The gateway in front of a port nothing listens on."""
    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:
        yield client


def test_voice_changes_without_a_bearer_key_are_401(unreachable):
    for r in (
        unreachable.post("/v1/audio/voices", data={"name": "v"}, files={"file": ("a.wav", b"x")}),
        unreachable.delete("/v1/audio/voices/v", headers={"Authorization": "Basic abc"}),
    ):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_unreachable_server_is_503_with_retry_after(unreachable):
    for r in (
        unreachable.post("/v1/audio/speech", json={"input": "Anyone there?"}),
        unreachable.get("/v1/audio/voices"),
        unreachable.delete("/v1/audio/voices/v", headers={"Authorization": "Bearer k"}),
        unreachable.get("/health"),
    ):
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "service_unavailable"


def openai_error(r, status: int, kind: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]


def test_a_form_with_too_many_fields_is_an_openai_400(unreachable):
    """Starlette's own refusals (here its 1,000-field limit on a form) come in OpenAI's shape too."""
    form = "&".join(f"f{i}=x" for i in range(1001))
    r = unreachable.post("/v1/audio/edits", content=form, headers={"content-type": "application/x-www-form-urlencoded"})
    assert "fields" in openai_error(r, 400, "invalid_request_error")["message"].lower()
    r = unreachable.post("/v1/audio/edits", files={f"f{i}": (None, "x") for i in range(1001)})
    assert "fields" in openai_error(r, 400, "invalid_request_error")["message"].lower()


def test_unknown_routes_and_methods_are_openai_errors(unreachable):
    openai_error(unreachable.get("/v1/nothing-here"), 404, "not_found_error")
    r = unreachable.put("/v1/audio/speech", json={})
    openai_error(r, 405, "invalid_request_error")
    assert r.headers.get("allow")  # the methods it takes, as Starlette says them
