"""What a client that does not mean well can reach, against a real tritonserver: Triton's admin APIs are
closed without the admin key, the internal models answer only our pipeline, the tts queue is bounded,
and requests waiting for a slot leave the running streams to end (bench/responsiveness.py times them)."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from client import ServerBusy, TTSClient, TTSError
from loadtest import attacks
from serving import contract
from serving.security.auth import Keys
from serving.supervision.triton_env import GRPC_ADMIN_HEADER
from tests.integration.helpers import SILENT, GeneratorPipe, gateway_for, in_parallel, metrics, wait_gauges_zero

pytestmark = pytest.mark.integration

EVIL_CONFIG = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]})  # fmt: skip
EVIL_CODE = b"import os\nos.system('touch /tmp/pwned-by-tts-test')\nclass TritonPythonModel:\n    pass\n"


def http(server, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(f"http://127.0.0.1:{server.ports.http}{path}", data=data, method=method,
                                 headers=headers or {})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


HTTP_ADMIN_CALLS = {
    "load a model with uploaded code": ("POST", "/v2/repository/models/evil/load",
                                        {"parameters": {"config": EVIL_CONFIG,
                                                        "file:1/model.py": base64.b64encode(EVIL_CODE).decode()}}),
    "unload tts": ("POST", "/v2/repository/models/tts/unload", {}),
    "repository index": ("POST", "/v2/repository/index", {}),
    "system shared memory register": ("POST", "/v2/systemsharedmemory/region/r/register",
                                      {"key": "/tts-test-region", "offset": 0, "byte_size": 64}),
    "system shared memory status": ("GET", "/v2/systemsharedmemory/status", None),
    "system shared memory unregister": ("POST", "/v2/systemsharedmemory/unregister", {}),
    "cuda shared memory register": ("POST", "/v2/cudasharedmemory/region/r/register",
                                    {"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0,
                                     "byte_size": 64}),
    "cuda shared memory status": ("GET", "/v2/cudasharedmemory/status", None),
    "logging settings": ("POST", "/v2/logging", {"log_verbose_level": 3}),
    "trace settings": ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_file": "/tmp/t"}),
}  # fmt: skip


def _after_admin_attempts(server) -> None:
    """Nothing an admin call would have done is visible: tts serves, no model or file appeared."""
    assert http(server, "GET", "/v2/models/tts/ready")[0] == 200
    status, index = http(server, "POST", "/v2/repository/index", {}, {"admin-key": server.triton_key})
    assert status == 200 and "evil" not in index
    assert not (server.model_repository / "evil").exists()
    status, text = http(server, "GET", "/v2/logging", headers={"admin-key": server.triton_key})
    assert status == 200 and json.loads(text)["log_verbose_level"] == 0


@pytest.mark.parametrize("call", sorted(HTTP_ADMIN_CALLS))
def test_http_admin_api_refused_without_the_key(server, call):
    method, path, body = HTTP_ADMIN_CALLS[call]
    for headers in ({}, {"admin-key": "wrong"}, {"admin-key": server.admin_key}):  # the voices key is not Triton's
        status, text = http(server, method, path, body, headers)
        assert status == 403 and "restricted" in text, (call, status, text)
    _after_admin_attempts(server)


GRPC_ADMIN_CALLS = {
    "load a model with uploaded code": lambda c, **kw: c.load_model("evil", config=EVIL_CONFIG,
                                                                    files={"file:1/model.py": EVIL_CODE}, **kw),
    "unload tts": lambda c, **kw: c.unload_model("tts", **kw),
    "repository index": lambda c: c.get_model_repository_index(),
    "system shared memory register": lambda c: c.register_system_shared_memory("r", "/tts-test-region", 64),
    "system shared memory status": lambda c: c.get_system_shared_memory_status(),
    "system shared memory unregister": lambda c: c.unregister_system_shared_memory(),
    "cuda shared memory register": lambda c: c.register_cuda_shared_memory("r", bytes(64), 0, 64),
    "cuda shared memory status": lambda c: c.get_cuda_shared_memory_status(),
    "logging settings": lambda c: c.update_log_settings({"log_verbose_level": 3}),
    "trace settings": lambda c: c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
}  # fmt: skip


@pytest.mark.parametrize("call", sorted(GRPC_ADMIN_CALLS))
def test_grpc_admin_api_refused_without_the_key(server, call):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            GRPC_ADMIN_CALLS[call](client)
    finally:
        client.close()
    _after_admin_attempts(server)


PWNED = Path("/tmp/pwned-by-tts-test")  # what EVIL_CODE would write


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_no_key_loads_code_or_unloads_a_model(server, protocol):
    """--model-control-mode=none: with the admin key too, Triton refuses to load a model with uploaded code
    and to unload tts (HTTP 503 / gRPC UNAVAILABLE), and neither a log file nor a trace file can be set."""
    PWNED.unlink(missing_ok=True)
    key = server.triton_key
    if protocol == "http":
        for call in ("load a model with uploaded code", "unload tts"):
            status, text = http(server, *HTTP_ADMIN_CALLS[call], {"admin-key": key})
            assert status == 503 and "not allowed" in text, (call, status, text)
        for path, body in (("/v2/logging", {"log_file": "/tmp/tts-test-log"}),
                           ("/v2/trace/setting", {"trace_file": "/tmp/tts-test-trace"})):  # fmt: skip
            status, text = http(server, "POST", path, body, {"admin-key": key})
            assert status == 501, (path, status, text)
    else:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        try:
            for call in ("load a model with uploaded code", "unload tts"):
                with pytest.raises(InferenceServerException, match="not allowed") as refused:
                    GRPC_ADMIN_CALLS[call](client, headers={GRPC_ADMIN_HEADER: key})
                assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
        finally:
            client.close()
    _after_admin_attempts(server)
    assert TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize("Still here", parameters={"max_patches": 4}).size
    # checked after a whole request has been served since: a load would have run the code by then
    assert not PWNED.exists() and not Path("/tmp/tts-test-log").exists() and not Path("/tmp/tts-test-trace").exists()


def test_the_triton_key_opens_the_admin_apis_and_the_voices_key_does_not(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: server.triton_key}, as_json=True)
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: server.admin_key})
    finally:
        client.close()
    names = {m["name"] for m in index["models"]}
    assert names >= {"tts", "vocoder", server.generator_model} and "generator" not in names


# ---- the internal models ----
def _batched(model: str, values: dict, tc) -> list:
    return attacks.inputs(model, values, tc)


def _chunk(stream_id: int) -> dict:
    return {"STREAM_ID": stream_id, "LATENTS": np.zeros((8, contract.LATENT_DIM), np.float32),
            "PROMPT_LATENTS": np.zeros((4, contract.LATENT_DIM), np.float32), "LAST": False, "FINISH_REASON": "",
            "SEAL": (0, 12345)}  # fmt: skip


def _infer(server, protocol: str, model: str, values: dict, parameters: dict | None = None):
    tc = grpcclient if protocol == "grpc" else httpclient
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    client = tc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return client.infer(model, _batched(model, values, tc), parameters=parameters)
    finally:
        client.close()


def _vocoder(server, protocol: str, values: dict, parameters: dict | None = None) -> str:
    """One chunk to the (decoupled) vocoder over a gRPC stream or HTTP generate_stream -> FINISH_REASON."""
    if protocol == "grpc":
        results, errors = _generator_stream(server, values, 0, parameters, model="vocoder")
        assert results, errors
        assert results[-1].as_numpy("AUDIO").size == 0
        return contract.text_of(results[-1].as_numpy("FINISH_REASON"))
    body = {k: np.asarray(v).reshape(-1).tolist() if not isinstance(v, str) else v for k, v in values.items()}
    if parameters:
        body["parameters"] = parameters
    req = urllib.request.Request(f"http://127.0.0.1:{server.ports.http}/v2/models/vocoder/generate_stream",
                                 data=json.dumps(body).encode())  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.read().splitlines() if line.startswith(b"data:")]
    assert events[-1]["AUDIO"] == []
    return events[-1]["FINISH_REASON"]


def _generator_stream(
    server, values: dict, sequence_id: int, parameters: dict | None = None, start=True, timeout: float = 60,
    model: str | None = None,
):  # fmt: skip
    """Direct generator requests (under its secret name, unless ``model`` names another) over one gRPC stream
    -> (responses, errors)."""
    model = model or server.generator_model
    import queue

    got = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        seq = {"sequence_id": sequence_id, "sequence_start": start} if sequence_id else {}
        client.async_stream_infer(model, _batched(model, values, grpcclient), parameters=parameters, **seq)
        results, errors = [], []
        while True:
            try:
                result, error = got.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"no response for {timeout} s")
                break
            if error is not None:
                errors.append(str(error))
                break
            results.append(result)
            last = result.as_numpy("LAST")  # the vocoder answers once, with no LAST
            if last is None or last.reshape(-1)[0]:
                break
        return results, errors
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


OWN_ID, VICTIM_ID = (1 << 60) + 4242, (1 << 61) + 777  # key-less streams need ids nobody can guess


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream_id", [1, 12345, (7 << 32) | 99, (1 << 63) - 1])
def test_vocoder_refuses_stream_ids_the_generator_did_not_issue(server, protocol, stream_id):
    reason = _vocoder(server, protocol, _chunk(stream_id))
    assert reason.startswith("invalid: ") and "unknown stream" in reason and str(stream_id) not in reason
    assert metrics(server)["tts_vocoder_active_streams"] == 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_prompt_encoder_does_not_register_voices_for_strangers(server, protocol):
    clip = (0.1 * np.random.default_rng(1).standard_normal(16000)).astype(np.float32)
    values = {"REF_AUDIO": clip, "REF_SAMPLE_RATE": 16000, "REF_TEXT": "x", "REGISTER_NAME": "sneaky"}
    with pytest.raises(InferenceServerException, match="voices are registered through the voices model"):
        _infer(server, protocol, "prompt_encoder", values)
    with pytest.raises(InferenceServerException, match="voices are registered through the voices model"):
        _infer(server, protocol, "prompt_encoder", values, {"internal_key": "guessed"})
    from client.voices import VoiceClient

    assert "sneaky" not in [v["name"] for v in VoiceClient(f"127.0.0.1:{server.ports.grpc}").list()]


def test_key_less_streams_get_an_issued_id_not_their_correlation_id(server):
    """What tts_ensemble does (no key): its generation step runs the stream under an id of ours (random, 63
    bits: what the vocoder checks is each chunk's seal); the client's sequence id is not used."""
    results, errors = _generator_stream(server, SILENT, OWN_ID, {"max_patches": 3}, model="ensemble_generator")
    assert not errors and results
    ids = {int(r.as_numpy("STREAM_ID").reshape(-1)[0]) for r in results}
    assert len(ids) == 1 and OWN_ID not in ids
    assert 0 < ids.pop() < 2**63
    assert contract.text_of(results[-1].as_numpy("FINISH_REASON")) == "length"
    assert wait_gauges_zero(server)["tts_generator_active_slots"] == 0


@pytest.mark.parametrize("sequence_id", [1, 2, 99, (1 << 32) - 1, OWN_ID])
def test_no_client_can_address_the_generator(server, sequence_id):
    """Its name is a secret of the run; and who knows it still needs the internal key."""
    results, errors = _generator_stream(server, SILENT, sequence_id, {"max_patches": 3}, model="generator")
    assert not results and "unknown model" in errors[0].lower(), errors
    results, errors = _generator_stream(server, SILENT, sequence_id, {"max_patches": 3})
    assert not results and "forbidden: generator is internal" in errors[0]
    assert metrics(server)["tts_generator_active_slots"] == 0
    assert server.generator_model not in server.metrics_text()  # the metrics port calls it "generator"
    assert 'model="generator"' in server.metrics_text()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_ensemble_requests_need_no_sequence_id(server, protocol):
    """Triton would number them 1, 2, 3, ...; they no longer reach the generator's sequence batcher."""
    tc = grpcclient if protocol == "grpc" else httpclient
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    text = np.array([b"x"], np.object_).reshape(1, 1)
    t = tc.InferInput("TEXT", [1, 1], "BYTES")
    t.set_data_from_numpy(text)
    if protocol == "grpc":
        import queue

        got = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("tts_ensemble", [t], parameters={"max_patches": 3})
        reasons = []
        while not reasons or not reasons[-1]:
            result, error = got.get(timeout=60)
            assert error is None, error
            reasons.append(contract.text_of(result.as_numpy("FINISH_REASON")))
        client.stop_stream(cancel_requests=True)
        client.close()
        reason = reasons[-1]
    else:
        body = json.dumps({"TEXT": ["x"], "parameters": {"max_patches": 3}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tts_ensemble/generate_stream", data=body)
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [json.loads(line[5:]) for line in r.read().splitlines() if line.startswith(b"data:")]
        reason = events[-1]["FINISH_REASON"]
    reason = reason[0] if isinstance(reason, list) else reason
    assert reason == "length"


def _pipe(server) -> GeneratorPipe:
    """A pipe to the generator, as the pipeline opens one (tests/integration/helpers.py)."""
    url = f"127.0.0.1:{server.ports.grpc}"
    return GeneratorPipe(url, server.generator_model, server.internal_key, server.work_dir / "cancel")


def test_a_start_on_a_live_correlation_id_is_refused_and_leaves_its_stream_alone(server):
    """Triton itself hands a live sequence to a new START on its correlation id: why the pipeline's ids
    are 63 random bits (no client reaches the generator). Should two of ours ever collide, the generator
    refuses the newcomer by name, and the stream already running on that id runs on to its end."""
    with _pipe(server) as pipe:
        params = {"max_patches": 150, "chunk_first": 1, "chunk_next": 1}
        assert pipe.answer(pipe.send(SILENT, VICTIM_ID, params)) is None  # admitted
        t0 = time.monotonic()
        reason = pipe.answer(pipe.send(SILENT, VICTIM_ID, {"max_patches": 3}), timeout=20)
        print(f"newcomer answered in {time.monotonic() - t0:.1f} s")
        assert "in use" in reason and str(VICTIM_ID) not in reason
        chunks = pipe.read(VICTIM_ID, timeout=120)
        assert len(chunks) == 150 and chunks[-1].last and chunks[-1].finish_reason == "length"
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0
    audio = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize("Still serving", parameters={"max_patches": 4})
    assert audio.size == 4 * 3840


def test_a_client_cannot_pass_the_internal_key_through_tts(server):
    with pytest.raises(TTSError, match="unknown request parameters"):
        TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize("x", parameters={"internal_key": "guess"})


# ---- a sealed server: no ensemble, so the internal models refuse every key-less request ----
@pytest.fixture(scope="module")
def sealed(fronted):
    """2 slots, max_queue 2, no tts_ensemble: conftest's ``fronted`` (which test_grpc_front and test_http_front
    share), reached through its bounded fronts, which pass these requests on as they are."""
    return fronted


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sealed_internal_models_refuse_strangers(sealed, protocol):
    for params in (None, {"internal_key": "guessed"}):
        with pytest.raises(InferenceServerException, match="prompt_encoder is internal"):
            _infer(sealed, protocol, "prompt_encoder", {"TEXT": "x"}, params)
        reason = _vocoder(sealed, protocol, _chunk(Keys(sealed.internal_key).new_stream_id()), params)
        assert reason.startswith("forbidden: vocoder is internal")
    assert metrics(sealed)["tts_vocoder_active_streams"] == 0
    assert http(sealed, "GET", "/v2/models/tts_ensemble/ready")[0] != 200


def test_sealed_generator_refuses_strangers(sealed):
    for params in ({"max_patches": 3}, {"max_patches": 3, "internal_key": "guessed"}):
        results, errors = _generator_stream(sealed, SILENT, 99, params)
        assert not results and "generator is internal" in errors[0]
    assert metrics(sealed)["tts_generator_active_slots"] == 0
    audio = TTSClient(f"127.0.0.1:{sealed.ports.grpc}").synthesize("Our own pipeline", parameters={"max_patches": 4})
    assert audio.size == 4 * 3840


def _long(server, i: int, patches: int = 400):
    return TTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=120).stream(
        f"Long stream {i}", seed=i, parameters={"max_patches": patches, "chunk_first": 1, "chunk_next": 1}
    )


@pytest.mark.parametrize("protocol", ["grpc", "http", "gateway"])
def test_the_queue_is_bounded(sealed, protocol):
    """2 slots + max_queue 2: a fifth request is refused at once, the four keep going, all is freed."""
    import threading

    stop, chunks = threading.Event(), [0] * 4

    def consume(i):
        stream = _long(sealed, i)
        try:
            for _ in stream:
                chunks[i] += 1
                if stop.is_set():
                    break
        finally:
            stream.close()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # two running (audio sent), two waiting for a slot
    m = metrics(sealed)
    while (m.get("tts_requests_in_flight"), m.get("tts_requests_waiting")) != (4, 2) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = metrics(sealed)
    assert m["tts_requests_in_flight"] == 4 and m["tts_requests_waiting"] == 2
    if protocol == "gateway":  # the OpenAI-compatible gateway answers 503 with Retry-After
        import httpx

        with gateway_for(sealed) as url:
            r = httpx.post(f"{url}/v1/audio/speech", json={"input": "One too many", "max_patches": 4}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "service_unavailable" and "server busy" in r.json()["error"]["message"]
    else:
        port = sealed.ports.grpc if protocol == "grpc" else sealed.ports.http
        with pytest.raises(ServerBusy, match="server busy"):
            TTSClient(f"127.0.0.1:{port}", protocol, timeout=30).synthesize(
                "One too many", parameters={"max_patches": 4}
            )
    before, deadline = sum(chunks), time.monotonic() + 30
    while sum(chunks) <= before:  # the running streams go on: their next chunk, however slow the machine is now
        assert time.monotonic() < deadline, f"no chunk of the running streams in 30 s after the refusal: {chunks}"
        time.sleep(0.05)
    stop.set()  # the running two end; then the waiting two start, get a chunk and end
    for t in threads:
        t.join(60)
    m = wait_gauges_zero(sealed, 30)
    deadline = time.monotonic() + 30  # tts's gauges move a turn of its loop after the slots' (and a waiting
    while m["tts_requests_in_flight"] and time.monotonic() < deadline:  # request may be between two slots)
        time.sleep(0.05)
        m = metrics(sealed)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    assert m['tts_requests_total{outcome="busy"}'] >= 1 and m["tts_requests_in_flight"] == 0


def test_running_and_waiting_streams_all_end(server):
    """4 slots busy and 8 more requests waiting: the running streams and the waiting ones all end with
    their audio. How far apart the running ones' chunks come, against a run with none waiting, is a
    measurement (python -m bench.responsiveness): waiting requests once stalled them 10x (72 -> 757 ms)."""
    url = f"127.0.0.1:{server.ports.grpc}"
    params = {"max_patches": 30, "chunk_first": 1, "chunk_next": 1}

    running = [threading.Event() for _ in range(4)]  # set at each running stream's first chunk

    def one(i):
        if i < 4:
            chunks = []
            for chunk in TTSClient(url, timeout=120).stream(f"Running {i}", seed=i, parameters=params):
                chunks.append(chunk)
                running[i].set()
            return chunks
        assert all(e.wait(120) for e in running), "a running stream sent no audio"  # they hold the slots now
        return list(TTSClient(url, timeout=120).stream(f"Waiting {i}", seed=i, parameters={"max_patches": 3}))

    results = in_parallel(one, 12, timeout=300)
    samples = [sum(c.audio.size for c in results[i]) for i in range(12)]
    assert samples == [30 * 3840] * 4 + [3 * 3840] * 8  # every stream its whole length (the stop head is off)
    assert wait_gauges_zero(server)["tts_generator_active_slots"] == 0


def test_clients_leaving_early_do_not_disturb_other_streams(server):
    """Clients that leave their streams after a chunk or two, again and again, next to one that listens to
    the end: every stream gets its answer and nothing is left behind. (A cancelled stream's cleanup cut
    short freed its BLS request under the live stream: Triton then dropped it and the streams batched with
    it, whose clients hung, and the generator kept their slots.)"""
    import random
    import threading

    url, end, errors = f"127.0.0.1:{server.ports.grpc}", time.monotonic() + 8, []
    left, log_start = [0, 0], server.log_path.stat().st_size

    def leave_early(k):
        rng = random.Random(k)
        while time.monotonic() < end:
            params = {"max_patches": 40, "chunk_first": 1, "chunk_next": 1, "steps": 100}  # slow steps widen the race
            try:
                for i, _ in enumerate(TTSClient(url, timeout=20).stream(f"Leaving {k}", seed=k, parameters=params)):
                    if i >= rng.randint(0, 3):
                        break
                left[k] += 1
            except Exception as e:  # collected: the assertion below shows them all
                errors.append(f"{type(e).__name__}: {e}")

    def listen(k):
        while time.monotonic() < end:
            try:
                audio = TTSClient(url, timeout=20).synthesize(f"Listening {k}", seed=k, parameters={"max_patches": 12})
                assert audio.size == 12 * 3840
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=leave_early, args=(k,)) for k in range(2)]
    threads += [threading.Thread(target=listen, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert min(left) >= 3
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    with open(server.log_path, errors="replace") as f:
        f.seek(log_start)
        assert "no longer schedules" not in f.read()  # the safety net was not needed


def test_a_new_stream_waits_while_every_slot_is_held_and_runs_once_their_reader_leaves(server):
    """Every slot held by streams whose reader leaves (its pipe ends: the streams are lost): a new request
    waits for a slot meanwhile, then runs; it is not failed with 'all slots are in use'."""
    from concurrent.futures import ThreadPoolExecutor

    ids = [(1 << 59) + 1000 + i for i in range(4)]  # the server has 4 slots
    pipe = _pipe(server)
    try:
        for i in ids:
            assert pipe.answer(pipe.send(SILENT, i, {"max_patches": 300, "chunk_first": 1, "chunk_next": 1})) is None
        for i in ids:  # a newcomer on each live id: refused, the stream left alone
            assert "in use" in pipe.answer(pipe.send(SILENT, i, {"max_patches": 3}), timeout=20)
        client = TTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=60)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.synthesize, "Next", parameters={"max_patches": 4})
            t0 = time.monotonic()
            pipe.close()  # the reader leaves
            audio = waiting.result(60)
    finally:
        pipe.close()
    print(f"the new request was answered {time.monotonic() - t0:.1f} s after the slots' reader left")
    assert audio.size == 4 * 3840
    assert wait_gauges_zero(server, 30)["tts_generator_active_slots"] == 0


def test_the_generator_name_stays_in_the_run_private_files(server):
    """Its config needs the Triton key, the files that name it are this user's only, and the metrics port
    calls it ``generator`` (issue 30, item 5)."""
    secret = server.generator_model
    for model in (secret, "tts"):  # every model's config is restricted: the generator's names it
        assert http(server, "GET", f"/v2/models/{model}/config")[0] == 403
    status, text = http(server, "GET", f"/v2/models/{secret}/config", headers={"admin-key": server.triton_key})
    assert status == 200 and secret in text
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_config(secret)
    finally:
        client.close()
    assert server.log_path.stat().st_mode & 0o777 == 0o600 and secret in server.log_path.read_text(errors="replace")
    assert server.model_repository.stat().st_mode & 0o777 == 0o700
    assert secret not in server.metrics_text() and 'model="generator"' in server.metrics_text()
