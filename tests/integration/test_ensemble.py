"""tts_ensemble, the plain Triton composition prompt_encoder -> generator -> vocoder, against a real
tritonserver: the same audio as the tts front door, no cross-talk, and nothing left behind."""

from __future__ import annotations

import time

import numpy as np
import pytest

from client import TTSClient, TTSError
from engine.fireredtts3 import FireRedTTS3
from engine.params import GenerationParams
from tests.integration.helpers import in_parallel, metrics, wait_gauges_zero
from tests.reference import reference_audio, snr_db, spoken

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def offline(nostop_ckpt):
    import torch

    torch.set_num_threads(1)
    return FireRedTTS3.from_checkpoint(nostop_ckpt)


def client(server, model="tts_ensemble", protocol="grpc"):
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    return TTSClient(f"127.0.0.1:{port}", protocol, timeout=60, model=model)


def test_ensemble_equals_tts(server):
    rng = np.random.default_rng(8)
    ref = (0.1 * rng.standard_normal(20000)).astype(np.float32)
    kw = dict(seed=21, parameters={"max_patches": 9, "chunk_first": 2, "chunk_next": 3, "chunk_fixed": True},
              ref_audio=ref, ref_sample_rate=16000, ref_text="a voice")  # fmt: skip
    via_tts = client(server, "tts").synthesize("One segment only", **kw)
    via_ensemble = client(server, "tts_ensemble").synthesize("One segment only", **kw)
    assert via_ensemble.shape == via_tts.shape == (9 * 3840,)
    assert np.array_equal(via_tts, via_ensemble)


@pytest.mark.parametrize(
    ("text", "language"),
    [("**Note:** it costs $12.50, 20% off!", "English"), ("我有3个苹果，12.5元。", None), ("Dr. Smith at 10:30", None)],
)
def test_ensemble_speaks_through_the_same_front_end(server, text, language):
    """Cleaning, normalization and language detection happen for tts_ensemble too (in the generator):
    text that needs them gives tts's audio, and differs from the same text spoken raw."""
    kw = dict(seed=5, language=language, parameters={"max_patches": 6, "chunk_first": 2, "chunk_next": 2,
                                                       "chunk_fixed": True})  # fmt: skip
    via_tts = client(server, "tts").synthesize(text, **kw)
    via_ensemble = client(server, "tts_ensemble").synthesize(text, **kw)
    assert np.array_equal(via_tts, via_ensemble)
    raw = client(server, "tts").synthesize(text, **{**kw, "parameters": {**kw["parameters"], "normalize": False}})
    assert not np.array_equal(raw, via_tts)


def test_ensemble_with_nothing_to_speak_is_refused(server):
    with pytest.raises(TTSError, match="nothing to speak after cleaning"):
        client(server).synthesize("😀 \u200b", parameters={"max_patches": 4})
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_ensemble_over_http_equals_grpc(server):
    """No sequence id is needed (ensemble_generator gives each stream one of its own), so Triton's HTTP
    generate_stream, which cannot carry one, serves the ensemble too."""
    kw = dict(seed=4, parameters={"max_patches": 5, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True})
    over_http = client(server, protocol="http").synthesize("Over HTTP", **kw)
    assert over_http.shape == (5 * 3840,)
    assert np.array_equal(over_http, client(server).synthesize("Over HTTP", **kw))


def test_ensemble_streams_in_order_chunks(server):
    chunks = list(
        client(server).stream("Chunked", seed=2, parameters={"max_patches": 10, "chunk_first": 1, "chunk_next": 2})
    )
    assert len(chunks) >= 5
    assert chunks[0].audio.size == 3840 - 720  # one patch minus the iSTFT's open tail
    assert all(a.arrival <= b.arrival for a, b in zip(chunks, chunks[1:]))


def test_ensemble_takes_chunk_fixed(server):
    params = {"max_patches": 25, "chunk_first": 1, "chunk_next": 12, "chunk_fixed": True}
    chunks = client(server).stream("Fixed chunks", seed=5, parameters=params)
    assert [c.audio.size for c in chunks if c.audio.size] == [3840 - 720, 12 * 3840, 12 * 3840 + 720]


def test_concurrent_ensemble_streams_equal_solo_runs(server, offline):
    texts = [f"Ensemble stream {i}" for i in range(8)]
    lengths = [6, 9, 7, 12, 6, 10, 8, 11]
    results = in_parallel(
        lambda i: client(server).synthesize(texts[i], seed=200 + i, parameters={"max_patches": lengths[i]}), 8
    )
    for i in range(8):
        ref = reference_audio(
            offline, spoken(offline, texts[i]), GenerationParams(seed=200 + i, max_patches=lengths[i])
        )
        assert results[i].shape == ref.shape, i
        assert snr_db(ref, results[i]) >= 60, i
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_cancelled_ensemble_stream_is_ended_and_frees_everything(server):
    """Triton does not pass the cancellation to a running step, but it hands the vocoder the stream's next
    chunk already cancelled: the vocoder asks the generator to end the stream (it stops, cancelled,
    instead of running to max_patches) and frees its own state."""
    before = metrics(server).get('tts_ensemble_requests_total{outcome="cancelled"}', 0)
    it = client(server).stream("Cancelled in an ensemble", seed=5,
                               parameters={"max_patches": 1000, "chunk_first": 1, "chunk_next": 1})  # fmt: skip
    assert next(it).audio.size > 0
    it.close()
    deadline = time.monotonic() + 60
    m = metrics(server)
    while time.monotonic() < deadline and (m["tts_generator_active_slots"] or m["tts_vocoder_active_streams"]
                                           or m['tts_ensemble_requests_total{outcome="cancelled"}'] == before):  # fmt: skip
        time.sleep(0.2)
        m = metrics(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    assert m['tts_ensemble_requests_total{outcome="cancelled"}'] == before + 1  # ended, not run to max_patches
    assert client(server).synthesize("Still serving", seed=1, parameters={"max_patches": 6}).shape == (6 * 3840,)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(language="Klingon"), "Klingon"),
        (dict(parameters={"split_tokens": 40}), "split_tokens"),
        (dict(parameters={"steps": 2.5}), "steps"),
        (dict(voice_id="nobody"), "nobody"),
        (dict(ref_audio=np.zeros(100, np.float32), ref_sample_rate=5), "REF_SAMPLE_RATE"),
    ],
)
def test_ensemble_errors_reach_the_client_without_hanging(server, kw, needle):
    """The client's 60 s wait for a response bounds a hang; python -m bench.responsiveness times the errors."""
    with pytest.raises(TTSError, match=needle):
        client(server).synthesize("Hello", **kw)
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
