"""Text-in streams and the admission gate behind a real tritonserver (issue 47, rows 4 and 7), on a server of
the smallest gate (1 slot + 1 queued = 2 places): as many streams as places, each sending only whitespace, hold
none, so a whole-text request is served meanwhile with the same audio; a stream that then sends text is spoken;
the open streams and a stream's lifetime are bounded by name; refused STARTs leave every gauge at 0."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from client import AsyncTTSClient, Chunk, InvalidRequest, ServerBusy, TTSClient
from client.text_in import piece_request
from serving.config.repository import ServeOptions, build
from serving.contract import TEXT_STREAMS_PER_PLACE
from serving.flow.admission import Admission
from serving.intake.requests import MAX_TEXT_CHARS
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import serving, wait_gauges_zero

pytestmark = pytest.mark.integration
SLOTS, QUEUE = 1, 1
CAPACITY = SLOTS + QUEUE
LIFETIME = 15  # --text-max-seconds on this server: past the other tests' streams, short for its own test
TEXT = "A legitimate request, spoken whole."
FIELDS = {"seed": 5, "parameters": {"max_patches": 6, "split_tokens": 8, "chunk_fixed": True}}


@pytest.fixture(scope="module")
def small(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("admission")
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=SLOTS, max_queue=QUEUE, max_len=1024,
                        text_max_seconds=LIFETIME, cancel_dir=str(work / "cancel"), voice_dir=str(work / "voices"),
                        run_dir=str(work))  # fmt: skip
    with serving(TritonServer(build(work / "model_repository", opts), work, Ports.free())) as srv:
        srv.cancel_dir = work / "cancel"
        yield srv


@pytest.fixture(scope="module")
def url(small):
    return f"127.0.0.1:{small.ports.grpc}"


@pytest.fixture(scope="module")
def whole(url):
    """The legitimate request's audio on an idle server."""
    return TTSClient(url, timeout=120).synthesize(TEXT, **FIELDS)


def settled(server, seconds: float = 30.0) -> dict:
    """Every gauge of places, slots and streams back to 0 (the gauges move once per turn of tts's loop: waited
    for), and nothing held in the admission gate's file."""
    wait_gauges_zero(server)
    names = ("tts_requests_in_flight", "tts_requests_waiting", "tts_text_streams_open", "tts_generator_active_slots")
    deadline = time.monotonic() + seconds
    while any((m := server.metrics())[g] for g in names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {g: m[g] for g in names} == dict.fromkeys(names, 0)
    assert Admission(server.cancel_dir, None, CAPACITY, create=False).total() == 0
    assert 4 <= m["tts_start_window"] <= 1024  # the default window's bounds (engine.start_window)
    return m


async def until_open(server, n: int) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["tts_text_streams_open"] != n:
        assert time.monotonic() < deadline, server.metrics()
        await asyncio.sleep(0.1)


def test_streams_sending_only_whitespace_hold_no_place(url, small, whole):
    """Capacity-many streams keep themselves open with spaces: a whole-text request is served meanwhile, with
    the idle server's audio; then one of them speaks, and everything ends at 0."""

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            streams = [await tts.open_text(**FIELDS) for _ in range(CAPACITY)]
            for ts in streams:
                await ts.send(" ")
            await until_open(small, CAPACITY)
            for ts in streams:
                await ts.send(" \n")
            assert small.metrics()["tts_requests_in_flight"] == 0
            served = await asyncio.to_thread(TTSClient(url, timeout=120).synthesize, TEXT, **FIELDS)
            await streams[0].send(TEXT, flush=True)
            await streams[0].end()
            spoken = [item.audio async for item in streams[0] if isinstance(item, Chunk)]
            for ts in streams[1:]:
                await ts.end()
                assert [item async for item in ts if isinstance(item, Chunk)] == []
            return served, np.concatenate(spoken)

    served, spoken = asyncio.run(go())
    assert whole.size and np.array_equal(served, whole) and np.array_equal(spoken, whole)
    settled(small)


def test_the_open_streams_are_bounded(url, small):
    limit = TEXT_STREAMS_PER_PLACE * CAPACITY

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            streams = [await tts.open_text(**FIELDS) for _ in range(limit)]
            await until_open(small, limit)
            refused = await tts.open_text(**FIELDS)
            with pytest.raises(ServerBusy, match=f"too many open text streams \\({limit}, limit {limit}\\)"):
                async for _ in refused:
                    pass
            for ts in streams:
                await ts.end()
                assert [item async for item in ts if isinstance(item, Chunk)] == []

    asyncio.run(go())
    settled(small)


def test_refused_starts_leave_the_gauges_at_zero(url, small):
    """Issue 47, row 7: ten STARTs refused (a piece over the request's text bound) on one gRPC stream; on the
    code before, tts_requests_waiting read 10 afterwards with nothing in flight."""

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:

            async def send():
                for i in range(10):
                    yield piece_request("tts", 5000 + i, "x" * (MAX_TEXT_CHARS + 100), False, start=True)

            return [str(error) async for _result, error in tts._channel().stream_infer(send()) if error is not None]

    errors = asyncio.run(go())
    assert len(errors) == 10 and all("characters" in e for e in errors)
    m = settled(small)
    assert m['tts_requests_total{outcome="error"}'] >= 10


def test_a_stream_open_past_its_lifetime_is_ended_by_name(url, small):
    """A stream that keeps sending whitespace, well within the idle bound, ends at --text-max-seconds."""

    async def go():
        async with AsyncTTSClient(url, timeout=120) as tts:
            ts = await tts.open_text(**FIELDS)

            async def keep_alive():
                for _ in range(4 * LIFETIME):
                    await ts.send(" ")
                    await asyncio.sleep(1)

            feeder = asyncio.ensure_future(keep_alive())
            t0 = time.monotonic()
            try:
                with pytest.raises(InvalidRequest, match=f"open for over {LIFETIME} s without its end"):
                    async for _ in ts:
                        pass
                return time.monotonic() - t0
            finally:
                feeder.cancel()

    took = asyncio.run(go())
    assert LIFETIME - 1 < took < LIFETIME + 10
    settled(small)
