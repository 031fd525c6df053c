"""Whatever a client sends to the speech endpoints, the gateway answers 400 naming the field (or 413),
never 500; a request it accepts goes on to the server (here a closed port: 503). No Triton needed."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.fields import EXTRAS, KNOWN
from serving.supervision.triton_env import free_port

FAST = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
UNREACHABLE = 503  # what a request that passed every check gets from a server that cannot be reached


@pytest.fixture(scope="module")
def gateway():
    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:
        yield client


def check_refusal(r, body) -> None:
    """A 400 in OpenAI's shape whose ``param`` names a field the body has (or ``input``, which it lacks);
    a body that is not an object has no field to blame."""
    assert r.status_code in (400, 413, UNREACHABLE), (r.status_code, r.text, body)
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if r.status_code == 400:
        assert error["type"] == "invalid_request_error"
        if isinstance(body, dict):
            assert error["param"] in {*body, "input"}, (error, body)


surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc80\ud83d"])
strings = (
    st.text(st.characters(exclude_categories=()), max_size=8)  # lone surrogates included
    | surrogates
    | st.sampled_from(["mp3", "wav", "pcm", "sse", "audio", "default", "alloy", "auto", "English", "Hello there"])
)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats() | st.sampled_from([0, 1, 7, 2**63, -(2**63) - 1, 1.0, 2.5, float("nan"), float("inf")]) | strings
)  # fmt: skip
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3), max_leaves=8
)
keys = st.sampled_from(sorted(KNOWN)) | strings
bodies = st.dictionaries(keys, values, max_size=6) | st.fixed_dictionaries(
    {"input": st.sampled_from(["Hello there", "\ud800", " "]) | values},
    optional={k: values for k in sorted(KNOWN - {"input"})},
)


@FAST
@given(bodies | values)
def test_post_speech_never_fails_on_what_it_is_sent(gateway, body):
    r = gateway.post("/v1/audio/speech", content=json.dumps(body).encode())  # ASCII: surrogates as \ud800
    check_refusal(r, body)


query_texts = strings | values.map(json.dumps) | st.sampled_from(
    ["1", "-3", "2.5", "1e999", "NaN", "true", "false", "9" * 5000, " 7", "0x10", "１２", "[1]", "{}"]
)  # fmt: skip


@FAST
@given(st.dictionaries(keys, query_texts, max_size=6), st.booleans())
def test_get_speech_never_fails_on_what_it_is_sent(gateway, query, with_input):
    if with_input:
        query.setdefault("input", "Hello there")
    # percent-encoded as UTF-8; a lone surrogate as the bytes it would be (a client can send them)
    qs = "&".join(f"{quote(k, safe='', errors='surrogatepass')}={quote(v, safe='', errors='surrogatepass')}"
                  for k, v in query.items())  # fmt: skip
    r = gateway.get(f"/v1/audio/speech?{qs}")
    check_refusal(r, {k.encode("utf-8", "surrogatepass").decode("utf-8", "replace"): v for k, v in query.items()})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": ["mp3"]}, "response_format"),
        ({"stream_format": {"a": 1}}, "stream_format"),
        ({"voice": ["alloy"]}, "voice"),
        ({"language": {"name": "English"}}, "language"),
        ({"model": [1]}, "model"),
        ({"instructions": ["whisper"]}, "instructions"),
        ({"input": "a\ud800b"}, "input"),
        ({"voice": "\udfff"}, "voice"),
        ({"language": "Engl\ud800ish"}, "language"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 7.0}, "seed"),
        ({"steps": 2**64}, "steps"),
        ({"steps": [1]}, "steps"),
        ({"cfg": 10**400}, "cfg"),
        ({"cfg": float("nan")}, "cfg"),
        ({"max_patches": "8"}, "max_patches"),
        ({"chunk_first": True}, "chunk_first"),
        ({"chunk_next": {"n": 1}}, "chunk_next"),
        ({"split_tokens": -1}, "split_tokens"),
        ({"normalize": 1}, "normalize"),
        ({"speed": True}, "speed"),
        ({"speed": [1.0]}, "speed"),
        ({"speed": 0.2}, "speed"),  # OpenAI's range, 0.25..4.0
        ({"speed": 4.5}, "speed"),
        ({"speed": 0}, "speed"),
        ({"\ud800": 1}, "\ud800"),
    ],
)  # fmt: skip
def test_each_malformed_field_is_a_400_naming_it(gateway, body, param):
    r = gateway.post("/v1/audio/speech", content=json.dumps({"input": "Hello", **body}).encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    if param in EXTRAS:  # the server's own words for its parameters
        assert r.json()["error"]["message"].startswith(f"parameter {param} ")


@pytest.mark.parametrize("depth", [1_000, 30_000])
def test_json_nested_too_deep_is_a_400(gateway, depth):
    for raw in ("[" * depth + "]" * depth, '{"input": "Hi", "steps": ' + "[" * depth + "]" * depth + "}"):
        r = gateway.post("/v1/audio/speech", content=raw.encode())
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_a_value_nested_almost_too_deep_is_a_400_naming_its_field(gateway):
    """Parsed, but too deep to show in a message: the message says what it is instead."""
    for depth in (200, 900, 960):
        raw = '{"input": "Hi", "steps": ' + "[" * depth + "]" * depth + "}"
        r = gateway.post("/v1/audio/speech", content=raw.encode())
        assert r.status_code == 400, r.text
        if r.json()["error"]["param"] is not None:  # else: too deep to parse at all
            assert r.json()["error"] == {**r.json()["error"], "param": "steps",
                                         "message": "parameter steps must be an integer, got a list"}  # fmt: skip


@pytest.mark.parametrize(
    ("query", "param"),
    [({"steps": "[1]"}, "steps"), ({"steps": "lots"}, "steps"), ({"cfg": "nan"}, "cfg"), ({"seed": "1e3"}, "seed"),
     ({"normalize": "1"}, "normalize"), ({"max_patches": "9" * 5000}, "max_patches"), ({"speed": "fast"}, "speed"),
     ({"chunk_first": " 7"}, "chunk_first"), ({"split_tokens": "１２"}, "split_tokens")],
)  # fmt: skip
def test_get_values_that_are_not_numbers_or_booleans_are_400(gateway, query, param):
    r = gateway.get("/v1/audio/speech", params={"input": "Hello", **query})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    "body",
    [{"input": "Hello"}, {"input": "Hello", "seed": -(2**63), "steps": 1, "cfg": "2.5", "normalize": False},
     {"input": "Hello", "model": "tts-1", "voice": "alloy", "response_format": "wav", "speed": 1, "instructions": ""},
     {"input": "Hello", "speed": 0.25}, {"input": "Hello", "speed": 4}, {"input": "Hello", "speed": 1.5},
     {"input": "Hello", "language": None, "voice": None, "seed": None}],  # null: absent
)  # fmt: skip
def test_a_well_formed_request_goes_on_to_the_server(gateway, body):
    r = gateway.post("/v1/audio/speech", json=body)
    assert r.status_code == UNREACHABLE and r.json()["error"]["type"] == "service_unavailable", r.text
    query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in body.items() if v is not None}
    assert gateway.get("/v1/audio/speech", params=query).status_code == UNREACHABLE
