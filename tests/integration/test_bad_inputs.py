"""Bad input against a real server, each case over gRPC (a stream) and HTTP (``generate_stream``).

Every case must fail with a message that names the input or parameter as the client spelled it, and as
INVALID_ARGUMENT. Neither transport shows the code of a decoupled model's error (a gRPC stream error is a
message; ``generate_stream`` answers any error with 400), so that is checked in the server log, where tts
logs every error it answers as INTERNAL. Afterwards the server is unharmed: a valid request gives the
audio it gave before, and the gauges are 0.

A few wrong JSON types never reach a model over HTTP: Triton 2.51's ``generate_stream`` parser refuses
them with status 500 and a message that names no input (``TRITON_PARSER``); those rows pin that.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from client import TTSClient
from client.request import grpc_inputs, http_error_text, is_final
from serving.contract import TTS_PARAMETERS, input_spec
from tests.integration.helpers import wait_gauges_zero

pytestmark = pytest.mark.integration

TRITON_PARSER = "Unable to parse"  # Triton's HTTP JSON-to-tensor conversion, before any model
CLIP = (0.1 * np.random.default_rng(3).standard_normal(8000)).astype(np.float32)
GOOD_REF = {"REF_AUDIO": CLIP, "REF_SAMPLE_RATE": 16000}


@dataclass(frozen=True)
class Raw:
    """An input sent exactly so: ``datatype`` and ``array`` over gRPC, ``json`` over HTTP (None: not expressible)."""

    datatype: str
    array: np.ndarray
    json: object = None


@dataclass(frozen=True)
class Case:
    id: str
    needle: str  # what the message must contain: the input or parameter as the client spelled it
    inputs: dict = field(default_factory=dict)  # merged over TEXT="Hi"; None removes an input
    parameters: dict = field(default_factory=dict)  # merged over max_patches=3
    grpc: bool = True  # expressible over gRPC (tritonclient)
    http: str | None = "model"  # "model": 400 naming needle; TRITON_PARSER: Triton's 500; None: not expressible


def bad_utf8(prefix: bytes = b"") -> Raw:
    return Raw("BYTES", np.array([prefix + b"\xff\xfe\xc3\x28"], np.object_), prefix + b"\xff\xfe\xc3\x28")


PARAMETER_CASES = [
    Case(f"{p.name}_{tag}", p.name, parameters={p.name: value})
    for p in TTS_PARAMETERS
    if p.type is int
    for tag, value in [
        ("below", p.low - 1),
        ("above", p.high + 1),
        ("fraction", 2.7),
        ("bool", True),
        ("garbage", "lots"),
        ("huge", 2**62),
    ]
] + [
    Case("cfg_below", "cfg", parameters={"cfg": -0.5}),
    Case("cfg_above", "cfg", parameters={"cfg": 20.5}),
    Case("cfg_nan", "cfg", parameters={"cfg": float("nan")}),
    Case("cfg_inf", "cfg", parameters={"cfg": float("inf")}),
    Case("cfg_nan_text", "cfg", parameters={"cfg": "nan"}),
    Case("cfg_bool", "cfg", parameters={"cfg": True}),
    Case("cfg_garbage", "cfg", parameters={"cfg": "lots"}),
    Case("speed_below", "speed", parameters={"speed": 0.2}),
    Case("speed_above", "speed", parameters={"speed": 4.5}),
    Case("speed_nan", "speed", parameters={"speed": float("nan")}),
    Case("speed_garbage", "speed", parameters={"speed": "fast"}),
    Case("normalize_int", "normalize", parameters={"normalize": 1}),
    Case("normalize_text", "normalize", parameters={"normalize": "false"}),
    Case("chunk_fixed_int", "chunk_fixed", parameters={"chunk_fixed": 1}),
    Case("unknown_parameter", "stepz", parameters={"stepz": 3}),
    Case("unicode_parameter", "stéps", parameters={"stéps": 3}),
    Case("parameter_null", "steps", parameters={"steps": None}, grpc=False),  # gRPC parameters cannot be null
    Case("parameter_list", "steps", parameters={"steps": [3]}, grpc=False),
    Case("parameter_object", "steps", parameters={"steps": {"value": 3}}, grpc=False),
]

INPUT_CASES = [
    Case("text_missing", "TEXT", inputs={"TEXT": None}),
    Case("text_empty", "TEXT", inputs={"TEXT": ""}),
    Case("text_blank", "TEXT", inputs={"TEXT": " \n\t "}),
    Case("text_too_long", "TEXT", inputs={"TEXT": "a" * 4001}),
    Case("text_only_emoji", "TEXT", inputs={"TEXT": "\U0001f600\U0001f389"}),  # nothing left after cleaning
    Case("text_only_zero_width", "TEXT", inputs={"TEXT": "\u200b\ufeff"}),
    Case("text_invalid_utf8", "TEXT", inputs={"TEXT": bad_utf8(b"Hi ")}),
    Case("text_no_elements", "TEXT", inputs={"TEXT": Raw("BYTES", np.zeros(0, np.object_), [])}),
    Case("text_two_elements", "TEXT", inputs={"TEXT": Raw("BYTES", np.array([b"a", b"b"], np.object_), ["a", "b"])}),
    Case("text_wrong_dtype", "TEXT", inputs={"TEXT": Raw("INT32", np.array([5], np.int32), 5)}, http=TRITON_PARSER),
    Case("language_unknown", "LANGUAGE", inputs={"LANGUAGE": "Klingon"}),
    Case("language_invalid_utf8", "LANGUAGE", inputs={"LANGUAGE": bad_utf8()}),
    Case(
        "language_wrong_dtype",
        "LANGUAGE",
        inputs={"LANGUAGE": Raw("FP32", np.ones(1, np.float32), 1.5)},
        http=TRITON_PARSER,
    ),
    Case("ref_text_invalid_utf8", "REF_TEXT", inputs={**GOOD_REF, "REF_TEXT": bad_utf8()}),
    Case("ref_text_without_audio", "REF_TEXT", inputs={"REF_TEXT": "a transcript"}),
    Case("ref_text_too_long", "REF_TEXT", inputs={**GOOD_REF, "REF_TEXT": "a" * 4001}),
    # control tokens of the tokenizer would become special ids (normalize off: nothing rewrites them)
    Case("text_control_token", "TEXT", inputs={"TEXT": "Say <|eot|> now"}, parameters={"normalize": False}),
    Case("text_im_start", "TEXT", inputs={"TEXT": "<|im_start|>system"}),
    Case(
        "text_control_token_zero_width",
        "TEXT",
        inputs={"TEXT": "Say <|e\u200bot|> now"},
        parameters={"normalize": False},
    ),
    Case("ref_text_control_token", "REF_TEXT", inputs={**GOOD_REF, "REF_TEXT": "a <|sosp|> transcript"}),
    Case("voice_id_invalid_utf8", "VOICE_ID", inputs={"VOICE_ID": bad_utf8()}),
    Case("voice_id_unknown", "VOICE_ID", inputs={"VOICE_ID": "nobody_here"}),
    Case("voice_id_path", "VOICE_ID", inputs={"VOICE_ID": "../x"}),
    Case("voice_id_too_long", "VOICE_ID", inputs={"VOICE_ID": "v" * 65}),
    Case("voice_id_and_ref_audio", "VOICE_ID", inputs={**GOOD_REF, "VOICE_ID": "narrator"}),
    Case("ref_audio_nan", "REF_AUDIO", inputs={**GOOD_REF, "REF_AUDIO": np.array([0.1, np.nan], np.float32)}),
    Case("ref_audio_inf", "REF_AUDIO", inputs={**GOOD_REF, "REF_AUDIO": np.array([np.inf, 0.1], np.float32)}),
    Case("ref_audio_1e30", "REF_AUDIO", inputs={**GOOD_REF, "REF_AUDIO": np.full(800, 1e30, np.float32)}),
    Case("ref_audio_int16_scale", "REF_AUDIO", inputs={**GOOD_REF, "REF_AUDIO": (CLIP * 32767).round()}),
    Case("ref_audio_empty", "REF_AUDIO", inputs={**GOOD_REF, "REF_AUDIO": np.zeros(0, np.float32)}),
    Case(
        "ref_audio_too_long",
        "REF_AUDIO",
        inputs={"REF_AUDIO": np.zeros(61 * 8000, np.float32), "REF_SAMPLE_RATE": 8000},
    ),
    Case(
        "ref_audio_wrong_dtype",
        "REF_AUDIO",
        inputs={**GOOD_REF, "REF_AUDIO": Raw("FP64", np.zeros(8), "abc")},
        http=TRITON_PARSER,
    ),
    Case(
        "ref_audio_2d",
        "REF_AUDIO",
        inputs={**GOOD_REF, "REF_AUDIO": Raw("FP32", np.zeros((2, 4), np.float32))},
        http=None,
    ),  # HTTP flattens nested lists: no shape to get wrong
    Case("ref_audio_without_rate", "REF_SAMPLE_RATE", inputs={"REF_AUDIO": CLIP}),
    Case("ref_sample_rate_zero", "REF_SAMPLE_RATE", inputs={**GOOD_REF, "REF_SAMPLE_RATE": 0}),
    Case("ref_sample_rate_negative", "REF_SAMPLE_RATE", inputs={**GOOD_REF, "REF_SAMPLE_RATE": -16000}),
    Case("ref_sample_rate_low", "REF_SAMPLE_RATE", inputs={**GOOD_REF, "REF_SAMPLE_RATE": 4000}),
    Case("ref_sample_rate_huge", "REF_SAMPLE_RATE", inputs={**GOOD_REF, "REF_SAMPLE_RATE": 2**31 - 1}),
    Case("ref_sample_rate_without_audio", "REF_SAMPLE_RATE", inputs={"REF_SAMPLE_RATE": 16000}),
    Case(
        "ref_sample_rate_wrong_dtype",
        "REF_SAMPLE_RATE",
        inputs={**GOOD_REF, "REF_SAMPLE_RATE": Raw("FP32", np.array([16000.5], np.float32), 16000.5)},
        http=TRITON_PARSER,
    ),
    Case(
        "ref_sample_rate_two_elements",
        "REF_SAMPLE_RATE",
        inputs={**GOOD_REF, "REF_SAMPLE_RATE": Raw("INT32", np.array([16000, 16000], np.int32), [16000, 16000])},
    ),
    Case(
        "seed_wrong_dtype", "SEED", inputs={"SEED": Raw("FP32", np.array([2.7], np.float32), 2.7)}, http=TRITON_PARSER
    ),
    Case("seed_two_elements", "SEED", inputs={"SEED": Raw("INT64", np.array([1, 2], np.int64), [1, 2])}),
    Case("unknown_input", "FOO", inputs={"FOO": Raw("INT32", np.ones(1, np.int32), 1)}),
]

CASES = INPUT_CASES + PARAMETER_CASES


def names(needle: str, message: str) -> bool:
    """``needle`` as a whole name in the message, not inside another (TEXT in REF_TEXT) or in the list
    of known parameters that an unknown one gets."""
    return re.search(rf"(?<![A-Za-z_]){re.escape(needle)}(?![A-Za-z_])", message.split("; known:")[0]) is not None


def request_of(case: Case) -> tuple[dict, dict]:
    inputs = {k: v for k, v in ({"TEXT": "Hi"} | case.inputs).items() if v is not None}
    return inputs, {"max_patches": 3} | case.parameters


def grpc_call(url: str, inputs: dict, parameters: dict) -> tuple[list[np.ndarray], str | None]:
    """One tts request on a gRPC stream -> (audio chunks, error message or None)."""
    tensors = []
    for name, value in inputs.items():
        if isinstance(value, Raw):
            t = grpcclient.InferInput(name, list(value.array.shape), value.datatype)
            t.set_data_from_numpy(value.array)
            tensors.append(t)
        else:
            tensors += grpc_inputs({name: value})
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("tts", tensors, parameters=parameters, enable_empty_final_response=True)
        chunks = []
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                return chunks, error.message()
            if result.as_numpy("AUDIO") is not None:
                chunks.append(result.as_numpy("AUDIO"))
            if is_final(result):
                return chunks, None
    finally:
        client.stop_stream()
        client.close()


def http_body(inputs: dict, parameters: dict) -> bytes:
    """The generate_stream body; bytes values go in raw (invalid UTF-8 included)."""
    raw, body = {}, {}
    for name, value in inputs.items():
        if isinstance(value, Raw):
            value = value.json
        if isinstance(value, bytes):
            raw[f"@raw{len(raw)}@"] = value
            value = f"@raw{len(raw) - 1}@"
        body[name] = value.tolist() if isinstance(value, np.ndarray) else value
    text = json.dumps(body | {"parameters": parameters}).encode()
    for marker, value in raw.items():
        text = text.replace(marker.encode(), value)
    return text


def http_call(port: int, body: bytes) -> tuple[int, str]:
    """POST generate_stream -> (status, the error message, or "" for a stream that ended well)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v2/models/tts/generate_stream", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    for line in data.splitlines():
        if line.startswith(b"data:") and "error" in (event := json.loads(line[5:])):
            return resp.status, event["error"]
    return resp.status, "" if resp.status == 200 else http_error_text(data)


def valid_audio(server) -> tuple[np.ndarray, np.ndarray]:
    """The same valid request (a reference clip, a seed) over gRPC and HTTP."""
    kw = {
        "ref_audio": CLIP,
        "ref_sample_rate": 16000,
        "ref_text": "a clip",
        "seed": 11,
        "parameters": {"max_patches": 5, "chunk_fixed": True},  # compared bit for bit: fixed chunks
    }
    by_grpc = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize("Still the same.", **kw)
    by_http = TTSClient(f"127.0.0.1:{server.ports.http}", "http").synthesize("Still the same.", **kw)
    return by_grpc, by_http


def log_size(server) -> int:
    return server.log_path.stat().st_size


@pytest.fixture(scope="module")
def before(server):
    return valid_audio(server), log_size(server)


def test_cases_cover_every_input_and_parameter():
    named = {c.needle for c in CASES}
    assert {"TEXT", "LANGUAGE", "REF_AUDIO", "REF_SAMPLE_RATE", "REF_TEXT", "VOICE_ID", "SEED"} <= named
    assert {p.name for p in TTS_PARAMETERS} <= named
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert all(input_spec("tts", n) for c in CASES for n in c.inputs if n != "FOO")


@pytest.mark.parametrize("case", [c for c in CASES if c.grpc], ids=lambda c: c.id)
def test_grpc(server, before, case):
    chunks, error = grpc_call(f"127.0.0.1:{server.ports.grpc}", *request_of(case))
    assert error is not None, f"accepted: {sum(c.size for c in chunks)} samples"
    print(f"{case.id}: {error}")
    assert names(case.needle, error), error


@pytest.mark.parametrize("case", [c for c in CASES if c.http], ids=lambda c: c.id)
def test_http(server, before, case):
    status, error = http_call(server.ports.http, http_body(*request_of(case)))
    if case.http == TRITON_PARSER:
        assert status == 500 and error.startswith(TRITON_PARSER), (status, error)
    else:
        assert status == 400 and names(case.needle, error), (status, error)


VOICES_CASES = [
    ("nan", {"REF_AUDIO": np.array([np.nan, 0.1], np.float32)}, "REF_AUDIO"),
    ("peak", {"REF_AUDIO": CLIP * 32767}, "REF_AUDIO"),
    ("too_long", {"REF_AUDIO": np.zeros(61 * 8000, np.float32), "REF_SAMPLE_RATE": 8000}, "REF_AUDIO"),
    ("rate", {"REF_SAMPLE_RATE": 0}, "REF_SAMPLE_RATE"),
    ("name", {"NAME": "../x"}, "NAME"),
    ("ref_text", {"REF_TEXT": "a" * 4001}, "REF_TEXT"),
]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(("tag", "fields", "needle"), VOICES_CASES, ids=[c[0] for c in VOICES_CASES])
def test_voices_add(server, protocol, tag, fields, needle):
    tc = grpcclient if protocol == "grpc" else httpclient
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    values = {"ACTION": "add", "NAME": "bad_input", **GOOD_REF, "REF_TEXT": ""} | fields
    client = tc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException) as e:
            client.infer("voices", grpc_inputs(values, tc, "voices"), parameters={"admin_key": server.admin_key})
    finally:
        client.close()
    assert names(needle, e.value.message()), e.value.message()
    assert e.value.status() in ("StatusCode.INVALID_ARGUMENT", "400"), e.value.status()


def test_server_is_unharmed(server, before):
    (grpc_before, http_before), log_start = before
    by_grpc, by_http = valid_audio(server)
    assert by_grpc.size and np.array_equal(by_grpc, grpc_before)
    assert np.array_equal(by_http, http_before)
    with open(server.log_path, "rb") as f:
        f.seek(log_start)
        failed = [line for line in f.read().decode("utf-8", "replace").splitlines() if "request failed" in line]
    assert not failed, failed  # every bad input was answered as invalid, none logged as a failure
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
