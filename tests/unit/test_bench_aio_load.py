"""The asyncio load client (bench.aio_load) judges streams exactly as the threaded one (bench.load), closed
and open loop, on a fake client (no server)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench import aio_load
from bench.load import one_stream
from bench.openloop import Arrival
from client import SAMPLE_RATE, ServerBusy
from client.tts_client import Chunk

# per text: (seconds after the request each chunk comes, its samples), then what the stream raises at its end.
# The fake clients pace their chunks by this schedule but stamp each with its planned time, not the clock's:
# what the bench computes from the stamps is then exact, however late a loaded machine wakes the fake up.
PLANS = {
    "smooth": ([(0.01, 4800), (0.05, 4800), (0.10, 4800)], None),  # each chunk while the one before plays
    "stall": ([(0.01, 240), (0.12, 4800)], None),  # 10 ms of audio, then ~110 ms of silence
    "busy": ([], ServerBusy("server busy")),
    "cut": ([(0.01, 2400)], TimeoutError("no response")),
}


class SyncClient:
    def stream(self, text, seed=None, **kw):
        t0 = time.perf_counter()
        chunks, exc = PLANS[text]
        for at, samples in chunks:
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            yield Chunk(np.zeros(samples, np.float32), at)
        if exc is not None:
            raise exc


class AsyncClient:
    def __init__(self, gate: asyncio.Event | None = None, starts_to_open: int = 0):
        self.started, self.gate, self.starts_to_open = 0, gate, starts_to_open
        self.most_at_once, self.running = 0, 0

    async def stream(self, text, seed=None, **kw):
        t0 = time.perf_counter()
        self.started += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.gate is not None:
                if self.started >= self.starts_to_open:
                    self.gate.set()
                await asyncio.wait_for(self.gate.wait(), 5)
            chunks, exc = PLANS[text]
            for at, samples in chunks:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                yield Chunk(np.zeros(samples, np.float32), at)
            if exc is not None:
                raise exc
        finally:
            self.running -= 1


@pytest.mark.parametrize("text", list(PLANS))
def test_a_stream_is_judged_as_the_threaded_client_judges_it(text):
    threaded = one_stream(SyncClient(), text, 0, {})
    looped = asyncio.run(aio_load.one_stream(AsyncClient(), text, 0, {}))
    assert (looped.error is None) == (threaded.error is None) and looped.failure == threaded.failure
    assert looped.audio == threaded.audio == sum(s for _, s in PLANS[text][0]) / SAMPLE_RATE
    assert (looped.worst_gap > 0) == (threaded.worst_gap > 0) == (text == "stall")
    if text == "stall":  # 10 ms of audio from 0.01 s, the next chunk at 0.12 s: silent from 0.02 s to 0.12 s
        assert looped.worst_gap == threaded.worst_gap == pytest.approx(0.10)
        assert looped.first_chunk == threaded.first_chunk == 0.01


def test_a_level_keeps_at_most_its_concurrency_in_flight_and_seeds_each_stream():
    client = AsyncClient()
    level = asyncio.run(aio_load.run_level(client, 3, 7, ["smooth"], {}))
    assert client.most_at_once == 3 and client.started == 7
    assert level.summary()["requests"] == 7 and level.summary()["errors"] == 0
    assert level.summary()["underruns"] == 0


def test_open_loop_arrivals_start_while_earlier_streams_still_run():
    """Five streams that each wait until all five have started: had the loop waited for one to end before
    the next arrival, none would end before the gate's timeout."""

    async def run():
        client = AsyncClient(asyncio.Event(), starts_to_open=5)
        arrivals = [Arrival(0.02 * i, "smooth", i) for i in range(5)]
        return await aio_load.run_rate(client, arrivals, 50, 0.1, {}, drain_timeout=5)

    level = asyncio.run(run())
    assert [s.arrival.seed for s in level.streams] == [0, 1, 2, 3, 4]
    assert all(s.result.error is None for s in level.streams)
    assert all(s.sent >= s.arrival.at for s in level.streams)


def test_streams_running_past_the_drain_timeout_end_as_timeouts():
    slow = {"slow": ([(0.01, 2400), (1.0, 2400), (1.05, 2400)], None)}

    async def run():
        return await aio_load.run_rate(AsyncClient(), [Arrival(0.0, "slow", 0)], 1, 0.05, {}, drain_timeout=0.1)

    PLANS.update(slow)
    try:
        level = asyncio.run(run())
    finally:
        del PLANS["slow"]
    (stream,) = level.streams
    assert stream.result.failure == "timeout" and stream.result.audio == pytest.approx(0.1)


def test_the_load_process_answers_levels_and_rates_as_results():
    """The process of its own, over its pipe, against a port where nothing listens: every stream comes back
    a failure of the kind the in-process client gives (unavailable), with its arrival for the open loop."""
    import socket

    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with aio_load.LoadProcess(f"127.0.0.1:{port}", timeout=10) as load:
        level = load.level(2, 3, ["a", "b"], {"parameters": {"max_patches": 8}})
        rate = load.rate([Arrival(0.0, "a", 0), Arrival(0.05, "b", 1)], 20, 0.1, {}, drain_timeout=1)
        assert load.proc.poll() is None
    assert load.proc.returncode == 0
    assert [s.failure for s in level.streams] == ["unavailable"] * 3 and level.concurrency == 2
    assert [(s.arrival.seed, s.result.failure) for s in rate.streams] == [(0, "unavailable"), (1, "unavailable")]
    assert rate.streams[1].sent >= 0.05
