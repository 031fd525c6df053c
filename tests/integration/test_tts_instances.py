"""``--tts-instances 2``: the front door as two stub processes (docs/architecture.md, "tts's instances"). One
server start: both instances exist and beat, concurrent requests all complete with the single-instance server's
audio bit for bit, a pace request reaches the paced request whichever instance Triton hands it to, a cancelled
request frees its place and slot, the gateway's paced stream plays, and a text-in stream is refused by name."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from client import AsyncTTSClient, TTSClient, TTSError
from engine.protocol import SAMPLE_RATE
from serving.config.repository import build
from serving.flow.admission import Admission
from serving.supervision.run_folder import HEARTBEATS
from serving.supervision.supervise import find_stubs
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import gateway_for, metrics, serving, wait_gauges_zero

pytestmark = pytest.mark.integration

PARAMS = {"max_patches": 12, "chunk_first": 2, "chunk_next": 3, "chunk_fixed": True}
SEEDS = range(6)


@pytest.fixture(scope="module")
def two(server_options, tmp_path_factory):
    """A server like the session's, with two tts instances."""
    work = tmp_path_factory.mktemp("two")
    opts = dataclasses.replace(server_options, tts_instances=2, cancel_dir=str(work / "cancel"),
                               voice_dir=str(work / "voices"), run_dir=str(work))  # fmt: skip
    # no log tail printed at its stop: that runs on a thread while the worker's next module runs, and went into
    # that module's captured output (test_bench_gpu's capsys read a Triton log line); its log stays in ``work``
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free())) as srv:
        yield srv


def url(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


def audio(server, seed: int, **kw) -> np.ndarray:
    return TTSClient(url(server), timeout=60).synthesize("Two front doors.", seed=seed, parameters=PARAMS, **kw)


def cpu(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def tts_stubs(server) -> list[int]:
    return sorted(pid for pid, model in find_stubs(server.model_repository).items() if model == "tts")


def test_two_stub_processes_each_beating(two):
    pids = tts_stubs(two)
    assert len(pids) == 2
    beats = {p.name for p in (two.work_dir / HEARTBEATS).iterdir()}
    assert {f"tts.{pid}" for pid in pids} <= beats


def test_concurrent_requests_get_the_single_instance_audio(two, server):
    expected = {seed: audio(server, seed) for seed in SEEDS}  # one instance (the session's server), one by one
    pids = tts_stubs(two)
    before, ok = {pid: cpu(pid) for pid in pids}, metrics(two).get('tts_requests_total{outcome="ok"}', 0)
    with ThreadPoolExecutor(len(SEEDS)) as pool:  # twice, so that both instances are handed some
        got = list(pool.map(lambda s: audio(two, s % len(SEEDS)), range(2 * len(SEEDS))))
    for i, a in enumerate(got):
        assert a.tobytes() == expected[i % len(SEEDS)].tobytes()
    assert all(cpu(pid) > before[pid] for pid in pids), "an instance served nothing"
    # the instances' metric families of one name are one: both count into it (serving.stub.metric_batch). A
    # request is counted after its final response is sent, so the count may trail the client by a moment
    want, deadline = ok + 2 * len(SEEDS), time.monotonic() + 10
    while (counted := metrics(two).get('tts_requests_total{outcome="ok"}', 0)) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted == want


async def paced(server, **kw) -> tuple[int, Exception | None]:
    """A paced request whose client takes a chunk every 0.3 s: samples received, the error that ended it."""
    samples, error = 0, None
    async with AsyncTTSClient(url(server), timeout=60) as tts:
        try:
            async for chunk in tts.stream("Paced by either door.", seed=3, parameters={**PARAMS, "max_patches": 40},
                                          pace=True, **kw):  # fmt: skip
                samples += chunk.audio.size
                await asyncio.sleep(0.3)
        except TTSError as e:
            error = e
    return samples, error


def test_pace_requests_reach_the_paced_request_from_either_instance(two):
    """Its lead is 0.96 s and it reads far slower than the tiny model speaks: it is paused, and only the pace
    requests Triton hands to either instance resume it (a lost one would end it at the 4 s hold bound)."""
    samples, error = asyncio.run(paced(two))
    assert error is None and samples == 40 * 0.16 * SAMPLE_RATE
    assert not list((Path(two.work_dir / "cancel") / "pace").iterdir())  # its token is free again


def test_a_pace_token_nobody_holds_is_refused_by_either_instance(two):
    from tritonclient.grpc import aio

    from client.pace import pace_request

    async def forge() -> list[str]:
        client = aio.InferenceServerClient(url(two))
        try:

            async def four():  # (Triton hands each to either instance)
                for _ in range(4):
                    yield pace_request("tts", "forged-token-of-nobody", 1.0)

            answers = []
            async for result, error in client.stream_infer(four()):
                answers.append(str(error) if error is not None else f"answered: {result.get_response()}")
                if len(answers) == 4:
                    return answers
        finally:
            await client.close()

    answers = asyncio.run(forge())
    assert all("no running request has this pace token" in a for a in answers), answers


def test_a_cancelled_request_frees_its_place_and_slot(two):
    it = TTSClient(url(two), timeout=60).stream("A very long utterance", seed=2, parameters={"max_patches": 400})
    assert next(it).audio.size > 0
    it.close()  # stop_stream(cancel_requests=True)
    m = wait_gauges_zero(two, timeout=15)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    gate = Admission(two.work_dir / "cancel", None, 1, create=False)
    assert gate.slots_held() == 0
    assert metrics(two)["tts_requests_in_flight"] == 0 and gate.total() == 0


def test_the_gateways_paced_stream_plays(two):
    with gateway_for(two) as gateway:
        r = httpx.post(f"{gateway}/v1/audio/speech", json={"model": "fireredtts3", "input": "Through the gateway",
                                                            "seed": 7, "response_format": "pcm",
                                                            "max_patches": 12}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.content) == 2 * 12 * 0.16 * SAMPLE_RATE  # s16le


def test_a_text_in_stream_is_refused_by_name(two):
    async def run():
        async with AsyncTTSClient(url(two), timeout=60) as tts:
            stream = await tts.open_text(seed=1)
            await stream.send("Hello there.", flush=True)
            await stream.end()
            return [item async for item in stream]

    with pytest.raises(TTSError, match="text-in streams need --tts-instances 1"):
        asyncio.run(run())


def test_the_option_is_bounded():
    from serving.config.options import ServeOptions

    for n in (0, 9):
        with pytest.raises(ValueError, match="tts_instances must be in 1..8"):
            ServeOptions(tts_instances=n)
