"""A server with ``--synthetic-math`` (benchmarks only): streams get exactly their patches' samples through
tts and tts_ensemble, and the server says it is synthetic in its log and metrics."""

from __future__ import annotations

import numpy as np
import pytest

from client import TTSClient
from engine.config import PATCH_SAMPLES
from engine.synthetic import TONE_LEVEL
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import in_parallel, serving, wait_gauges_zero

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def synthetic(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("synthetic")
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=2, max_len=256, synthetic_math=True,
                        cancel_dir=str(work / "cancel"), voice_dir=str(work / "voices"), run_dir=str(work))  # fmt: skip
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free())) as srv:
        yield srv


def test_streams_get_their_patches_of_ready_made_audio(synthetic):
    # three streams on two slots: one waits for a slot; chunk schedules of their own (the second fixed: its
    # chunk sizes are asserted, and the deadline rule cuts earlier when a client's buffer runs low)
    cases = [
        (40, {}),
        (17, {"chunk_first": 1, "chunk_next": 5, "chunk_fixed": True}),
        (9, {"chunk_first": 9, "chunk_next": 9}),
    ]
    tts = TTSClient(f"127.0.0.1:{synthetic.ports.grpc}", timeout=60)

    def one(i):
        patches, chunking = cases[i]
        return [c.audio for c in tts.stream(f"Stream number {i}.", seed=i,
                                            parameters={"max_patches": patches, **chunking})]  # fmt: skip

    got = in_parallel(one, len(cases))
    for i, (patches, _) in enumerate(cases):
        audio = np.concatenate(got[i])
        assert audio.size == patches * PATCH_SAMPLES, i
        assert 0 < np.abs(audio).max() <= TONE_LEVEL + 1e-6  # the quiet tone, not the tiny model's noise
    assert [a.size for a in got[1]] == [PATCH_SAMPLES] + [5 * PATCH_SAMPLES] * 3 + [PATCH_SAMPLES]
    ensemble = TTSClient(f"127.0.0.1:{synthetic.ports.grpc}", timeout=60, model="tts_ensemble")
    assert ensemble.synthesize("Through the ensemble.", parameters={"max_patches": 11}).size == 11 * PATCH_SAMPLES
    m = wait_gauges_zero(synthetic)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_the_benchmarks_load_process_streams_whole_utterances(synthetic):
    """bench.ceiling's load (bench.aio_load, a process of its own): three streams on two slots, each complete
    with its patches' audio; the open loop's stream too, with its arrival."""
    from bench.aio_load import LoadProcess
    from bench.openloop import Arrival

    request = {"parameters": {"max_patches": 12}}
    with LoadProcess(f"127.0.0.1:{synthetic.ports.grpc}", timeout=60) as load:
        level = load.level(3, 3, ["One.", "Two."], request)
        rate = load.rate([Arrival(0.0, "Three.", 7)], 1.0, 0.1, request, drain_timeout=60)
    streams = [*level.streams, *(s.result for s in rate.streams)]
    assert [s.error for s in streams] == [None] * 4
    assert [round(s.audio * 24000) for s in streams] == [12 * PATCH_SAMPLES] * 4
    assert all(s.first_chunk is not None and s.first_chunk <= s.total for s in streams)
    assert rate.streams[0].arrival.seed == 7
    wait_gauges_zero(synthetic)


def test_the_server_says_it_is_synthetic(synthetic):
    m = synthetic.metrics(("tts_synthetic_math",))
    assert m == {'tts_synthetic_math{model="generator"}': 1.0, 'tts_synthetic_math{model="vocoder"}': 1.0}
    log = synthetic.log_path.read_text(errors="replace")
    assert "[generator] WARNING generator: SYNTHETIC MATH" in log and "[vocoder] WARNING vocoder: SYNTHETIC MATH" in log
