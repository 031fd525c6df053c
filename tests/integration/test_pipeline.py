"""The streaming invariants against a real tritonserver (tiny checkpoint, free loopback ports)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from client import TTSClient, TTSError
from engine.fireredtts3 import FireRedTTS3
from engine.params import GenerationParams
from tests.integration.helpers import in_parallel, metrics, wait_gauges_zero
from tests.reference import reference_audio, reference_long, snr_db, spoken

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def offline(nostop_ckpt):
    import torch

    torch.set_num_threads(1)
    return FireRedTTS3.from_checkpoint(nostop_ckpt)


def grpc(server, **kw):
    return TTSClient(f"127.0.0.1:{server.ports.grpc}", "grpc", timeout=60)


def test_stream_equals_offline(server, offline):
    params = {"max_patches": 8}
    chunks = list(grpc(server).stream("Hello streaming world", seed=11, parameters=params))
    got = np.concatenate([c.audio for c in chunks])
    ref = reference_audio(offline, "Hello streaming world", GenerationParams(seed=11, max_patches=8))
    assert got.shape == ref.shape == (8 * 3840,)
    assert snr_db(ref, got) >= 60
    assert len(chunks) >= 2


def test_stream_with_reference_voice_equals_offline(server, offline):
    rng = np.random.default_rng(5)
    ref_audio = (0.1 * rng.standard_normal(16000 + 123)).astype(np.float32)
    kw = dict(ref_audio=ref_audio, ref_sample_rate=16000, ref_text="a reference")
    got = grpc(server).synthesize("Cloned voice", seed=3, parameters={"max_patches": 6}, **kw)
    prompt = offline.encode_prompt(ref_audio, 16000, "a reference")
    ref = reference_audio(offline, "Cloned voice", GenerationParams(seed=3, max_patches=6), prompt)
    assert got.shape == ref.shape
    assert snr_db(ref, got) >= 60


def test_first_chunk_arrives_before_the_last_is_generated(server):
    chunks = list(
        grpc(server).stream(
            "Streaming order", seed=1, parameters={"max_patches": 24, "chunk_first": 3, "chunk_next": 6}
        )
    )
    assert len(chunks) >= 4
    assert chunks[0].audio.size == 3 * 3840 - 720  # 3 patches minus the iSTFT's open tail
    # 21 more patches were generated after the first chunk left; it arrived well before the end
    assert chunks[0].arrival < chunks[-1].arrival
    assert chunks[0].arrival < 0.5 * chunks[-1].arrival


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_chunk_fixed_crosses_bls_and_gives_the_fixed_schedule(server, protocol):
    """chunk_fixed, a bool, reaches the generator through tts's BLS request (BLS refuses floats): exactly
    1 patch, then 12 each. Without it the deadline rule cuts single patches after a 1-patch first chunk
    (the listener holds 160 ms, less than its margin) on any machine."""
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    tts = TTSClient(f"127.0.0.1:{port}", protocol, timeout=60)
    params = {"max_patches": 25, "chunk_first": 1, "chunk_next": 12}
    fixed = [c.audio.size for c in tts.stream("Fixed chunks", seed=5, parameters={**params, "chunk_fixed": True})]
    assert [n for n in fixed if n] == [3840 - 720, 12 * 3840, 12 * 3840 + 720]  # the iSTFT's tail comes last
    rule = [c.audio.size for c in tts.stream("Fixed chunks", seed=5, parameters=params)]
    assert sum(rule) == sum(fixed) and rule[1] < 12 * 3840


def test_concurrent_streams_equal_solo_runs(server, offline):
    texts = [f"Stream number {i} says something" for i in range(8)]
    seeds = [100 + i for i in range(8)]
    lengths = [6, 9, 7, 12, 6, 10, 8, 11]
    results = in_parallel(
        lambda i: grpc(server).synthesize(texts[i], seed=seeds[i], parameters={"max_patches": lengths[i]}), 8
    )
    for i in range(8):
        # the digit is read out: "Stream number zero says something"
        ref = reference_audio(
            offline, spoken(offline, texts[i]), GenerationParams(seed=seeds[i], max_patches=lengths[i])
        )
        assert results[i].shape == ref.shape, i
        assert snr_db(ref, results[i]) >= 60, i
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_http_generate_stream_equals_grpc(server):
    kw = dict(seed=9, parameters={"max_patches": 7})
    a = grpc(server).synthesize("Over HTTP", **kw)
    b = TTSClient(f"127.0.0.1:{server.ports.http}", "http", timeout=60).synthesize("Over HTTP", **kw)
    assert a.shape == b.shape
    assert snr_db(a, b) >= 60  # JSON carries float32 values as decimals


@pytest.mark.parametrize("chunks", [(1, 1), (3, 12)])
def test_cancel_frees_slot_and_vocoder_state(server, chunks):
    """(3, 12): the client cancels while the generator is inside a chunk, so tts hears of it only from
    its watcher and the generator's final response."""
    m0 = metrics(server)
    before = m0.get('tts_requests_total{outcome="cancelled"}', 0)
    it = grpc(server).stream(
        "A very long utterance",
        seed=2,
        parameters={"max_patches": 400, "chunk_first": chunks[0], "chunk_next": chunks[1]},
    )
    first = next(it)
    assert first.audio.size > 0
    it.close()  # stop_stream(cancel_requests=True)
    m = wait_gauges_zero(server, timeout=15)
    assert m["tts_generator_active_slots"] == 0
    assert m["tts_vocoder_active_streams"] == 0
    deadline = time.monotonic() + 10  # tts counts the outcome after it has freed the vocoder
    while m['tts_requests_total{outcome="cancelled"}'] < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        m = metrics(server)
    assert m['tts_requests_total{outcome="cancelled"}'] >= before + 1
    # the stream asked for 400 patches; cancellation stopped it after a few generator steps
    assert m["tts_generator_step_seconds_count"] - m0["tts_generator_step_seconds_count"] < 100


@pytest.mark.parametrize("chunks", [(1, 1), (3, 12)])
def test_http_disconnect_frees_slot(server, chunks):
    it = TTSClient(f"127.0.0.1:{server.ports.http}", "http", timeout=60).stream(
        "Another long one", seed=4, parameters={"max_patches": 400, "chunk_first": chunks[0], "chunk_next": chunks[1]}
    )
    m0 = metrics(server)
    next(it)
    it.close()
    m = wait_gauges_zero(server, timeout=30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    assert m["tts_generator_step_seconds_count"] - m0["tts_generator_step_seconds_count"] < 100


def test_only_the_pipes_read_receipt_is_open_once_the_streams_end(server):
    """tts paces what the generator sends on its pipe (serving.stub.chunk_pipe) by a read receipt
    (serving.flow.receipts, docs/triton.md#T23): its board exists, and once the streams above (cancelled ones
    too) are over, no entry is left open but its pipe's, which has counted the pipe's responses."""
    import struct

    from serving.flow.receipts import ENTRIES, FILE, HEAD

    grpc(server).synthesize("One more.", seed=5, parameters={"max_patches": 6, "chunk_first": 1, "chunk_next": 1})
    board = server.work_dir / "cancel" / f"{FILE}tts"

    def still_open() -> list[tuple[int, int]]:
        data = board.read_bytes()[HEAD:]  # (the reader's pid and held streams first)
        assert len(data) >= 16 * ENTRIES
        return [e for e in struct.iter_unpack("<qq", data) if e[0]]

    deadline = time.monotonic() + 30  # a pipe rotated meanwhile closes its entry once the generator ended it
    while len(left := still_open()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(left) == 1, f"entries still open: {left}"
    assert left[0][1] >= 2  # the pipe's: its opening, then at least one response of chunks


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(language="Klingon"), "Klingon"),
        (dict(parameters={"steps": 0}), "steps"),
        (dict(parameters={"bogus": 1}), "bogus"),
        (dict(ref_text="no audio"), "REF_TEXT"),
    ],
)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_input_gets_clear_error(server, kw, needle, protocol):
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    with pytest.raises(TTSError, match=needle):
        TTSClient(f"127.0.0.1:{port}", protocol, timeout=30).synthesize("Hello", **kw)


def test_server_still_serves_after_errors_and_metrics_count(server):
    with pytest.raises(TTSError):
        grpc(server).synthesize("", seed=1)
    audio = grpc(server).synthesize("Still alive", seed=1, parameters={"max_patches": 6})
    assert audio.shape == (6 * 3840,)
    m = metrics(server)
    assert m['tts_requests_total{outcome="error"}'] >= 1
    assert m['tts_requests_total{outcome="ok"}'] >= 1
    assert m["tts_first_chunk_seconds_count"] >= 1
    assert m["tts_audio_seconds_total"] > 0


def test_final_response_reports_finish_reason(server):
    """The nostop checkpoint always runs to max_patches: the final event says "length", not silently cut."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.ports.http, timeout=60)
    body = {"TEXT": "Cut short", "SEED": 1, "parameters": {"max_patches": 6}}
    conn.request("POST", "/v2/models/tts/generate_stream", json.dumps(body))
    events = [json.loads(line[5:]) for line in conn.getresponse() if line.startswith(b"data:")]
    conn.close()
    assert events[-1]["FINISH_REASON"] == "length"
    assert all("FINISH_REASON" not in e for e in events[:-1])


def test_generator_rejection_reaches_the_client(server):
    """A prompt longer than the server's cache is refused by the generator with a clear message."""
    with pytest.raises(TTSError, match="cache positions"):
        grpc(server).synthesize("word " * 700, seed=1, parameters={"max_patches": 400, "split_tokens": 0})
    assert grpc(server).synthesize("fine", seed=1, parameters={"max_patches": 6}).shape == (6 * 3840,)


def test_long_text_streams_like_offline(server, offline):
    text = (
        "The first sentence is here and it goes on for a while. The second one follows it closely. "
        "A third sentence arrives, talking about the weather and the sea. Finally the fourth ends it."
    )
    params = {"max_patches": 6, "split_tokens": 40}
    got = grpc(server).synthesize(text, seed=8, parameters=params)
    ref = reference_long(offline, text, GenerationParams(seed=8, max_patches=6), 40)
    assert got.shape == ref.shape and len(ref) > 2 * 6 * 3840
    assert snr_db(ref, got) >= 60
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


FRONT_END = [
    # (text, LANGUAGE, what the reference's front end makes of it, its language)
    ("I have 3 apples at 10:30.", "English", "I have three apples at ten thirty.", "English"),
    ("今天是2024年5月5日。", None, "今天是二零二四年五月五日。", "Chinese"),
]


@pytest.mark.parametrize("text,language,spoken,spoken_language", FRONT_END)
def test_front_end_runs_in_the_server_as_offline(server, offline, text, language, spoken, spoken_language):
    """The server speaks the normalized text in the detected language, exactly as the offline path does."""
    from engine.synthesize import synthesize

    params = GenerationParams(seed=5, max_patches=6)
    got = grpc(server).synthesize(text, language=language, seed=5, parameters={"max_patches": 6})
    ref = reference_audio(offline, spoken, params, language=spoken_language)
    assert got.shape == ref.shape == (6 * 3840,)
    assert snr_db(ref, got) >= 60
    assert snr_db(ref, synthesize(offline, text, language, params=params)) >= 60
    raw = reference_audio(offline, text, params, language=spoken_language)
    assert snr_db(raw, got) < 20  # the raw text's tokens would have given other audio


def test_normalize_false_speaks_the_cleaned_text(server, offline):
    params = GenerationParams(seed=5, max_patches=6)
    got = grpc(server).synthesize("I have 3 apples.", seed=5, parameters={"max_patches": 6, "normalize": False})
    assert snr_db(reference_audio(offline, "I have 3 apples.", params), got) >= 60


def test_text_with_nothing_to_speak_is_invalid(server):
    with pytest.raises(TTSError, match="TEXT: nothing to speak after cleaning"):
        grpc(server).synthesize("\U0001f600 \u200b", seed=1)


READ_AHEAD_TEXT = " ".join(f"Sentence number {n} is spoken here, one of several in a row." for n in range(6))


@pytest.mark.parametrize("task", ["base", "design"])
def test_read_ahead_gives_the_sequential_audio_byte_for_byte(server, task):
    """A long text with read_ahead 3 (its segments side by side in the server's batched steps) against the
    same request with read_ahead 1: the same bytes, streamed (chunk for chunk) and whole, for Base and an
    Instruct task: the server's batch-invariant mode (engine/invariant.py) makes a row's arithmetic the same
    whoever shares its batch (docs/serving.md#what-a-seed-guarantees). Fixed chunks: chunk sizes that
    follow the clock would move the vocoder's rounding. The two requests compared run side by side (1 + 3
    of the session server's 4 slots: none waits), which that mode allows too."""
    kw = {"instruction": "a calm older man, slightly hoarse"} if task == "design" else {}
    small = {"max_patches": 6, "split_tokens": 12, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}
    large = {**small, "chunk_first": 6, "chunk_next": 6}

    def streamed(read_ahead: int) -> list[np.ndarray]:
        chunks = grpc(server).stream(READ_AHEAD_TEXT, seed=5, parameters={**small, "read_ahead": read_ahead}, **kw)
        return [c.audio for c in chunks]

    def whole(read_ahead: int) -> np.ndarray:
        return grpc(server).synthesize(READ_AHEAD_TEXT, seed=5, parameters={**large, "read_ahead": read_ahead}, **kw)

    runs = in_parallel(lambda i: streamed((1, 3)[i]), 2, timeout=300)
    one, three = runs[0], runs[1]
    assert len(one) > 10 and sum(map(len, one)) > 5 * 6 * 3840 - 6 * 1200
    assert [a.tobytes() for a in three] == [a.tobytes() for a in one]
    if task == "base":
        assert [a.tobytes() for a in streamed(1)] == [a.tobytes() for a in one]  # and every run
    wholes = in_parallel(lambda i: whole((1, 3)[i]), 2, timeout=300)
    assert wholes[0].size == sum(map(len, one)) and wholes[0].tobytes() == wholes[1].tobytes()
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_a_request_beside_others_is_the_same_bytes_as_alone(server):
    """Four requests at once (their rows in one generator batch, their chunks in one vocoder batch) give each
    one's audio alone byte for byte: batch-invariant mode (docs/serving.md#what-a-seed-guarantees)."""
    params = {"max_patches": 8, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}
    texts = [f"Request number {i} speaks beside the others." for i in range(4)]
    alone = [grpc(server).synthesize(t, seed=20 + i, parameters=params) for i, t in enumerate(texts)]
    together = in_parallel(lambda i: grpc(server).synthesize(texts[i], seed=20 + i, parameters=params), 4)
    for i in range(4):
        assert together[i].tobytes() == alone[i].tobytes(), i
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_starts_beside_a_request_reading_ahead_are_served_and_everything_is_freed(server):
    """A request reading ahead holds every free slot (4 segments at once on 4 slots) while three other
    requests start: read-ahead yields them its slots (docs/serving.md#long-form-text-read-ahead), every
    request ends well, each one's audio is its bytes alone, and nothing stays held."""
    text = " ".join(f"Sentence number {n} is spoken here, one of several in a row." for n in range(4))
    params = {"max_patches": 8, "split_tokens": 12, "chunk_fixed": True}
    short = ["A second request comes in.", "A third one as well.", "And a fourth one too."]
    alone = [grpc(server).synthesize(t, seed=3, parameters=params) for t in short]
    sequential = grpc(server).synthesize(text, seed=5, parameters=params)

    def request(i):
        if i == 0:
            return grpc(server).synthesize(text, seed=5, parameters={**params, "read_ahead": 4})
        time.sleep(1.0)  # (once the long one reads ahead; the order changes what is compared with nothing)
        return grpc(server).synthesize(short[i - 1], seed=3, parameters=params)

    got = in_parallel(request, 4, timeout=300)
    assert got[0].tobytes() == sequential.tobytes()  # segments cancelled and run again included
    for i, want in enumerate(alone, 1):
        assert got[i].tobytes() == want.tobytes(), i  # batch-invariant mode: the same bytes as alone
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
