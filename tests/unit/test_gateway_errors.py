"""How the gateway turns the server's answers into OpenAI error statuses (no server needed)."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.utils import InferenceServerException

from client.request import grpc_error
from gateway.app import from_tts_error


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        # a model's error inside a gRPC stream carries only its message (Triton's stream protocol has no code)
        (InferenceServerException("TEXT: nothing to speak after cleaning"), 400, "invalid_request_error"),
        (InferenceServerException("server busy: 16 requests are running or waiting"), 503, "server_busy"),
        (_RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect"), 503, "server_unavailable"),
        (_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "no chunk in 60 s"), 504, "timeout"),
    ],
)  # fmt: skip
def test_server_answers_map_to_openai_statuses(error, status, kind):
    api = from_tts_error(grpc_error(error))
    assert (api.status, api.kind) == (status, kind)
    response = api.response()
    assert response.status_code == status
    assert (response.headers.get("retry-after") == "1") == (status == 503)
