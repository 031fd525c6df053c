"""The client's FireRedTTS3-Instruct requests without Triton: the inputs it sends for each task, and the
plan text read from a ``generate_stream`` answer written here by hand (Triton's SSE: one JSON object per
response, BYTES outputs as strings)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from client import TTSClient
from client.request import edit_task, grpc_inputs, http_body, plan_text, request_fields

PLAN = "性别：女；年龄：青年；语速：稍慢"


def test_instruct_fields_are_sent_as_the_contract_types_them():
    fields = request_fields("Hi", instruction="a calm older man", task="design", seed=2)
    inputs = {t.name(): (t.datatype(), t.shape()) for t in grpc_inputs(fields)}
    assert inputs == {"TEXT": ("BYTES", [1]), "INSTRUCTION": ("BYTES", [1]), "TASK": ("BYTES", [1]),
                      "SEED": ("INT64", [1])}  # fmt: skip


def test_an_edit_sends_no_text():
    fields = request_fields(None, ref_audio=np.zeros(3), ref_sample_rate=16000, instruction="Delete 'a'.",
                            task=edit_task("semantic"))  # fmt: skip
    assert set(fields) == {"REF_AUDIO", "REF_SAMPLE_RATE", "INSTRUCTION", "TASK"}
    assert json.loads(http_body(fields, {}))["TASK"] == "semantic_edit"
    assert edit_task("acoustic") == "acoustic_edit"
    with pytest.raises(ValueError, match="semantic or acoustic"):
        edit_task("loudness")


def test_the_ensemble_has_no_instruction_input():
    with pytest.raises(KeyError, match="INSTRUCTION"):
        grpc_inputs(request_fields("Hi", instruction="calm"), model="tts_ensemble")


@pytest.mark.parametrize(
    "value, text",
    [(None, None), (np.array([PLAN.encode()], dtype=object), PLAN), (np.zeros(0, dtype=object), None),
     (PLAN, PLAN), ([PLAN], PLAN), (b"plain", "plain")],
)  # fmt: skip
def test_plan_text_from_either_protocol(value, text):
    assert plan_text(value) == text


class GenerateStream(BaseHTTPRequestHandler):
    """Answers one generate_stream request: a plan response, two audio responses, the final one."""

    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        GenerateStream.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [
            {"PLAN_TEXT": PLAN},
            {"AUDIO": [0.5, 0.25]},
            {"AUDIO": [0.125]},
            {"AUDIO": [], "FINISH_REASON": "stop"},
        ]
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), GenerateStream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_plan_arrives_before_the_audio_over_http(http_server):
    seen = []
    tts = TTSClient(f"127.0.0.1:{http_server}", "http", timeout=5)
    for chunk in tts.stream("Hi", instruction="gentle", on_plan=lambda text: seen.append(("plan", text))):
        seen.append(("audio", chunk.audio.tolist()))
    assert seen == [("plan", PLAN), ("audio", [0.5, 0.25]), ("audio", [0.125])]
    assert GenerateStream.bodies[-1] == {"TEXT": "Hi", "INSTRUCTION": "gentle"}


def test_an_edit_over_http_posts_the_recording(http_server):
    tts = TTSClient(f"127.0.0.1:{http_server}", "http", timeout=5)
    audio = np.concatenate([c.audio for c in tts.edit(np.ones(4), 16000, "adjust the volume to 0.5", "acoustic")])
    assert audio.tolist() == [0.5, 0.25, 0.125]
    expected = {"REF_AUDIO": [1.0] * 4, "REF_SAMPLE_RATE": 16000, "INSTRUCTION": "adjust the volume to 0.5",
                "TASK": "acoustic_edit"}  # fmt: skip
    assert GenerateStream.bodies[-1] == expected
