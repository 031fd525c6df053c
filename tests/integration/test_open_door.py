"""The internal models are a public endpoint while tts_ensemble is served: what an unauthenticated client
sends them, against a real tritonserver, each attack at the smallest size that showed its effect before
the fix (loadtest/attacks.py replays them). After every attack a legitimate tts stream starts within
START_WITHIN seconds and gives the same audio as before it.

One server (2 slots, 2 waiting: every entry point shares one gate of 4) serves the module; its shutdown
must find nothing in flight (Triton 2.51 keeps a cancelled ensemble request, or a sequence slot,
in flight forever when they leak)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import ServerBusy, TTSClient
from loadtest import attacks
from serving import contract
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import serving, stuck_stacks
from tests.reference import snr_db

pytestmark = pytest.mark.integration
START_WITHIN = 10.0  # seconds: a legitimate stream's first chunk after an attack (it takes ~0.1 s here)
# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
LEGIT = {"text": "A legitimate stream.", "seed": 11,
         "parameters": {"max_patches": 6, "chunk_first": 2, "chunk_fixed": True}}  # fmt: skip
SLOTS, QUEUE = 2, 2


@pytest.fixture(scope="module")
def server(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("open-door")
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=SLOTS, max_queue=QUEUE, max_len=2048,
                        cancel_dir=str(work / "cancel"), voice_dir=str(work / "voices"),
                        run_dir=str(work))  # fmt: skip
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free()), then=none_in_flight) as srv:
        yield srv


def none_in_flight(srv) -> None:
    """Checked once the module's server has stopped (a failure fails the session at its end)."""
    import re

    log = srv.log_path.read_text("utf-8", "replace")
    left = re.findall(r"Model '\w+' \(version \d+\) has [1-9]\d* in-flight inferences", log)
    assert not left, f"left in flight at shutdown: {sorted(set(left))}"


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


@pytest.fixture(scope="module")
def legit_audio(url) -> np.ndarray:
    return TTSClient(url).synthesize(**LEGIT)


def gauges(server) -> dict[str, float]:
    m = server.metrics(("tts_", "nv_inference_pending_request_count"))
    pending = sum(v for k, v in m.items() if k.startswith("nv_inference_pending_request_count"))
    return {**{k: v for k, v in m.items() if k.startswith("tts_")}, "pending": pending}


def settled(server, timeout: float = 30.0) -> dict[str, float]:
    """The gauges once nothing is generating, decoding or waiting (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        m = gauges(server)
        busy = [
            m.get(k, 0)
            for k in (
                "tts_generator_active_slots",
                "tts_vocoder_active_streams",
                "pending",
                "tts_requests_in_flight",
                "tts_ensemble_requests_in_flight",
            )
        ]
        if not any(busy):
            return m
        if time.monotonic() > deadline:
            stuck_stacks(server)
            return m
        time.sleep(0.2)


def is_busy(answer: str) -> bool:
    """A busy refusal: at the ensemble's first step (prompt_encoder) it comes back as Triton's error wrapping
    of the same message ("error: in ensemble 'tts_ensemble', unavailable: server busy ..."); at a later step,
    as the last response's FINISH_REASON."""
    return answer.startswith(
        ("unavailable: server busy", "error: in ensemble 'tts_ensemble', unavailable: server busy")
    )


def still_serving(server, url, legit_audio) -> None:
    m = settled(server)
    assert m["tts_generator_active_slots"] == m["tts_vocoder_active_streams"] == m["pending"] == 0, m
    chunks = [chunk.audio for chunk in TTSClient(url, timeout=START_WITHIN).stream(**LEGIT)]  # each within it
    assert np.array_equal(np.concatenate(chunks), legit_audio)


def infer(url, model: str, values: dict):
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.infer(model, attacks.inputs(model, values))
    finally:
        client.close()


# ---- oversized tensors: refused before anything is decoded, allocated or queued ----
@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"LATENTS": 8000, "PROMPT_LATENTS": 4}, "LATENTS has 8000 rows; at most 1600"),
        ({"LATENTS": 4, "PROMPT_LATENTS": 8000}, "PROMPT_LATENTS has 8000 rows; at most 1500"),
    ],
)
def test_the_vocoder_refuses_oversized_chunks(server, url, legit_audio, values, needle):
    """4,000 prompt rows of an issued stream stalled every stream 3.4 s, 24,000 took 105 s and 15.7 GB."""
    first = attacks.sealed_chunks(url)[0]
    chunk = attacks.chunk(int(first["STREAM_ID"][0]), values["LATENTS"], values["PROMPT_LATENTS"],
                          seal=int(first["SEAL"][1]))  # fmt: skip
    answer = attacks.vocoder(url, chunk)
    assert answer.startswith("invalid: ") and needle in answer, answer
    assert gauges(server)["tts_vocoder_active_streams"] == 0
    still_serving(server, url, legit_audio)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        (
            "PROMPT_LATENTS",
            np.zeros((8000, contract.LATENT_DIM), np.float32),
            "PROMPT_LATENTS has 8000 rows; at most 1500",
        ),
        ("SPEAKER", np.zeros(100_000, np.float32), "SPEAKER has 100000 values"),
        ("TEXT", "word " * 5000, "TEXT is 25000 characters"),
    ],
)
def test_the_ensembles_generation_step_refuses_oversized_inputs(server, url, legit_audio, field, value, needle):
    results, errors = attacks.stream(url, "ensemble_generator", {**attacks.SILENT, field: value})
    assert not errors and len(results) == 1, errors
    answer = attacks.reason(results[0])
    assert answer.startswith("invalid: ") and needle in answer, answer
    still_serving(server, url, legit_audio)


def test_the_prompt_encoder_refuses_oversized_references(server, url, legit_audio):
    assert "invalid: REF_AUDIO is 61.0 s" in attacks.prompt_bomb(url, 61.0)
    with pytest.raises(InferenceServerException, match="invalid: TEXT is 4001 characters"):
        infer(url, "prompt_encoder", {"TEXT": "x" * 4001})
    still_serving(server, url, legit_audio)


def test_the_generator_answers_only_the_pipeline(server, url, legit_audio):
    """No client can address the sequence batcher (a request without START on a live id wedged a slot for
    good; a START cancelled while it waits held one): the generator's name is a secret of the run, and a
    key-less request under that name, however well formed, is refused too."""
    for values in (attacks.SILENT, {**attacks.SILENT, "PROMPT_LATENTS": np.zeros((8000, 64))}):
        results, errors = attacks.stream(url, "generator", values, sequence_id=attacks.random_id())
        assert not results and "unknown model" in errors[0].lower(), errors
        results, errors = attacks.stream(url, server.generator_model, values, sequence_id=attacks.random_id())
        assert not results and "forbidden: generator is internal" in errors[0], errors
    still_serving(server, url, legit_audio)


# ---- ids: the vocoder's table cannot be filled by streams the generator does not hold ----
def test_forged_and_replayed_ids_never_hold_vocoder_state(server, url, legit_audio):
    """80 issued ids used to fill an 80-stream vocoder table and lock everyone out, kept past its reaper
    by an empty chunk each 40 s; issued ids never expired. Now: twice the table of forged ids, then twice
    the table of replays of one genuine first chunk whose stream has ended."""
    bound = SLOTS + 64
    answers = attacks.vocoder_table(url, 2 * bound)
    forged, replays = answers[: 2 * bound], answers[2 * bound :]
    assert all(a.startswith("invalid: unknown stream") for a in forged)
    assert sum(a == "" for a in replays) <= 1  # its first use may still open it (the generator held it)
    assert all(a.startswith("invalid: unknown stream") for a in replays[1:])
    still_serving(server, url, legit_audio)  # the one opened is reclaimed: its generator stream is over


# ---- Triton's sequence slots ----
def test_refused_and_cancelled_generator_starts_leave_no_slot(server, url, legit_audio):
    """START requests to the generator, answered or cancelled while they wait, in a loop of 200: Triton
    2.51 never ends a sequence whose START was cancelled, so each kept a candidate slot for
    max_sequence_idle (600 s then): 50 of them froze every new stream for over a minute. No client reaches
    the generator's sequence batcher now; what an insider could leak is held 5 s here, 30 s by default."""
    answers = attacks.generator_direct(url, rounds=200)
    assert all("unknown model" in a.lower() for a in answers), sorted(set(answers))
    deadline = time.monotonic() + 5 + 20  # max_sequence_idle, and the reaper's rounds
    while gauges(server)["pending"] and time.monotonic() < deadline:
        time.sleep(0.5)
    still_serving(server, url, legit_audio)


# ---- one admission gate ----
def test_an_ensemble_flood_is_refused_as_busy_and_abandoned_streams_stop(server, url, legit_audio):
    """8 tts_ensemble streams of 1,900 patches left after their first chunk used to hold every slot for
    54 s, generating for nobody, with tts clients waiting and nobody told "busy"."""
    answers = attacks.ensemble_flood(url, 8, 1900, abandon_after=1)
    # beyond the gate's 4 places a stream is refused at once, unless an abandoned one has already given its
    # place back (test_tts_gets_audio_or_busy_at_once_during_an_ensemble_flood holds the gate full)
    busy = [a for a in answers if is_busy(a)]
    assert all(a == "" or a in busy for a in answers), answers  # the others were left after their first chunk
    m = settled(server, timeout=10)  # within a step of their next chunk, not after 1,900 patches (~20 s)
    assert m["tts_generator_active_slots"] == 0 and m["tts_ensemble_requests_in_flight"] == 0, m
    # ensemble_generator counts the streams it refused (FINISH_REASON), not those prompt_encoder refused
    refused_there = [a for a in busy if a.startswith("unavailable: server busy")]
    assert m['tts_ensemble_requests_total{outcome="busy"}'] >= len(refused_there)
    still_serving(server, url, legit_audio)


def test_tts_gets_audio_or_busy_at_once_during_an_ensemble_flood(server, url, legit_audio):
    """8 tts_ensemble streams read to their end (2 generating, 2 waiting for a slot, 4 refused): a tts request
    meanwhile is refused at once. The flood is waited for to its end, not for a fixed time: its last 2 streams
    start only when the first 2 have made their 150 patches, a minute or more on a loaded machine, and a flood
    still running made a loaded run fail ("2 tts_ensemble requests in flight", or at shutdown)."""
    answers: list[str] = []
    # a stream waiting for a slot hears nothing until one ahead of it ends: patience for that, not a hang
    flood = threading.Thread(target=lambda: answers.extend(attacks.ensemble_flood(url, 8, 150, 0, patience=600)))
    flood.start()
    try:
        deadline = time.monotonic() + 30
        while gauges(server).get("tts_ensemble_requests_in_flight", 0) < SLOTS + QUEUE and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ServerBusy, match="server busy"):  # within START_WITHIN: the client waits no longer
            TTSClient(url, timeout=START_WITHIN).synthesize(**LEGIT)
    finally:
        flood.join()  # every stream read to its last response or refused (ensemble_flood is bounded by patience)
    # each admitted stream was served to its end (the nostop checkpoint stops at max_patches), the others refused
    assert answers.count("length") >= SLOTS + QUEUE and all(a == "length" or is_busy(a) for a in answers), answers
    still_serving(server, url, legit_audio)


def test_ensemble_streams_need_no_sequence_id_and_cannot_take_each_other_over(server, url):
    """The same client sequence id on two streams at once (a START on a live ensemble id dropped the running
    stream, unanswered): each stream runs under a generator id of its own."""
    kw = {"model": "tts_ensemble", "timeout": 60}
    solo = [TTSClient(url, **kw).synthesize(f"Stream {i}", seed=i, parameters={"max_patches": 30}) for i in (1, 2)]
    out: dict = {}

    def run(i):
        client = grpcclient.InferenceServerClient(url)
        got = []
        done = threading.Event()

        def callback(result, error):
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                done.set()
            if error is None and result.as_numpy("AUDIO") is not None:
                got.append(result.as_numpy("AUDIO").reshape(-1))

        client.start_stream(callback=callback)
        text = contract.ENSEMBLE_INPUTS[0].array(f"Stream {i}")
        t = grpcclient.InferInput("TEXT", list(text.shape), "BYTES")
        seed = grpcclient.InferInput("SEED", [1, 1], "INT64")
        t.set_data_from_numpy(text)
        seed.set_data_from_numpy(np.array([[i]], np.int64))
        client.async_stream_infer("tts_ensemble", [t, seed], parameters={"max_patches": 30}, sequence_id=4242,
                                  sequence_start=True, enable_empty_final_response=True)  # fmt: skip
        done.wait(60)
        client.stop_stream()
        client.close()
        out[i] = np.concatenate(got) if got else np.zeros(0, np.float32)

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(90)
    for got, want in ((out[1], solo[0]), (out[2], solo[1])):  # batched beside each other: float-close, not bitwise
        assert got.shape == want.shape and snr_db(want, got) >= 60
    assert TTSClient(f"127.0.0.1:{server.ports.http}", "http", **kw).synthesize("Over HTTP too").size > 0
