"""The generator's engine thread (serving.stub.generator_host) with the tiny checkpoint, no Triton: response
senders and metrics are recorders. Every arrival ends with exactly one final response, slots come back,
a stream whose caller asked to stop (before or after it got a slot) ends cancelled, an id in use (live, or
its last chunk not sent yet) is refused without disturbing its stream. The stream's chunks are what the
same stream gives alone, in-process (engine.streams).

Every stream's chunks come on its reader's pipe (serving.stub.chunk_pipe), several streams' in one
response; their own requests get one final response without tensors as soon as they are admitted, before
any chunk (so that Triton's Python backend does not hold a thread for each live stream: docs/triton.md#T28);
a reader that is behind gets what waited in one response once it reads; a stream naming a pipe the
generator does not know is refused as unavailable; a pipe that cannot send loses its streams, each marked
lost."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.params import GenerationParams
from engine.protocol import CANCELLED, LENGTH, STOP, UNAVAILABLE
from engine.streams import GeneratorService
from serving.config.model_options import GeneratorOptions
from serving.flow.receipts import Receipts
from serving.security.auth import INTERNAL_KEY_ENV
from serving.stub.generator_host import Arrival, GeneratorHost
from serving.stub.generator_pipes import PipeOpening

PATCHES = 8  # at most (the tiny checkpoint's stop head may end a stream after 6)
SCHEDULE = ChunkSchedule(3, 2, fixed=True)


class Metric:
    def __init__(self, **kw):
        pass

    def set(self, value):
        raise AssertionError("Metric.set keeps the stub's GIL through its round trip (docs/triton.md#T19)")

    def observe(self, value):
        pass

    def increment(self, value):
        pass


class FakePb:
    class MetricFamily:
        GAUGE = COUNTER = HISTOGRAM = 0

        def __init__(self, *args):
            pass

        def Metric(self, **kw):
            return Metric()


class PipeSender:
    """A pipe's (or a stream's own) response sender: records ``(chunks, final)`` per response; ``broken``:
    every send raises, as for a caller that is gone; ``reader``: a pipe's receipt, counted as each response
    is sent (a reader that reads at once)."""

    def __init__(self, broken: bool = False):
        self.responses, self.broken, self.done = [], broken, threading.Event()
        self.reader = None

    def pipe(self, chunks, final: bool):
        if self.broken:
            raise RuntimeError("the request is gone")
        self.responses.append((chunks, final))
        if self.reader is not None:
            self.reader.read()
        if final:
            self.done.set()

    def chunks(self, stream_id: int | None = None) -> list:
        return [c for chunks, _ in self.responses for c in chunks or () if stream_id in (None, c.stream_id)]


@pytest.fixture
def host(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv(INTERNAL_KEY_ENV, "k" * 32)
    opts = GeneratorOptions(checkpoint=str(tiny_ckpt), device="cpu", run_dir="", cancel_dir=str(tmp_path),
                            slots=2, max_len=512, kv_memory_gb=0.0, attention="sdpa", synthetic_math=False, synthetic_step="", step_budget_ms=0.0,
                            batch_invariant=True,
                            models="")  # fmt: skip
    h = GeneratorHost(FakePb, opts, lambda sender, chunks, final: sender.pipe(chunks, final))
    yield h
    h.close()


def inputs(model, seed: int) -> tuple:
    prompt = model.encode_prompt(None)
    params = GenerationParams(seed=seed, max_patches=PATCHES)
    return model.tokens("Hello there.", "English", prompt), prompt, params, SCHEDULE


def alone(model, seed: int) -> list:
    """The stream's chunks from a service of its own, stepped in-process."""
    service = GeneratorService(model, 1, 512, attention="sdpa")
    service.admit(1, *inputs(model, seed))
    chunks = []
    while 1 in service.live:
        chunk = service.step([1])[1]
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def wait(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def same_as_alone(model, stream_id: int, chunks: list) -> None:
    want = alone(model, stream_id)
    assert [(len(c.latents), c.finish_reason) for c in chunks] == [(len(c.latents), c.finish_reason) for c in want]
    assert chunks[-1].last and chunks[-1].finish_reason in (LENGTH, STOP)
    got, expected = (np.concatenate([c.latents for c in x]) for x in (chunks, want))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)  # batched beside others: float-close


def test_every_arrival_ends_once_and_every_slot_comes_back(host, model):
    receipt = Receipts(host.channel.dir, "tts").open(9000)
    pipe = PipeSender()
    host.arrivals.put(PipeOpening(9000, pipe, host.receipts.entry(receipt.parameter)))  # its reader reads nothing yet
    ids = [101, 102, 103, 104, 105]
    own = {i: PipeSender(broken=i == 104) for i in ids}  # 104's caller left: its final cannot be sent
    host.channel.mark("cancel", 105)  # its caller left before it got one of the 2 slots
    for i in ids:
        host.arrivals.put(Arrival(i, inputs(model, seed=i), own[i], 9000))
    wait(lambda: 101 in host.pipes.riding)
    duplicate = PipeSender()  # an id in use: 101 is live, or its last chunk waits for the reader
    host.arrivals.put(Arrival(101, inputs(model, seed=1), duplicate, 9000))
    assert duplicate.done.wait(30)
    pipe.reader = receipt
    receipt.read()  # the reader reads the opening, then each response as it comes
    for i in (101, 102, 103, 105):
        assert own[i].done.wait(60)
    wait(lambda: not host.service.live and not host.pipes.riding)

    for i in (101, 102, 103, 104):  # complete, sealed, and as the stream is alone in-process
        assert own[i].responses == ([] if i == 104 else [(None, True)])  # its own request: answered at admission
        chunks = pipe.chunks(i)
        same_as_alone(model, i, chunks)
        assert all(host.keys.sealed(c) for c in chunks)
    (cancelled,) = own[105].chunks()
    assert own[105].responses == [([cancelled], True)] and cancelled.finish_reason == CANCELLED
    assert not pipe.chunks(105)
    (refusal,) = duplicate.chunks()
    assert duplicate.responses == [([refusal], True)] and "in use" in refusal.finish_reason
    assert not any(final for _, final in pipe.responses)  # the pipe stays open
    assert not host.service.live and len(host.service.free) == 2 and not host.waiting and not host.pipes.riding


def test_a_live_stream_whose_caller_leaves_ends_cancelled(host, model):
    pipe, own = PipeSender(), PipeSender()
    host.arrivals.put(PipeOpening(9003, pipe, None))
    long = GenerationParams(seed=1, max_patches=400, min_patches=400)  # the stop head never ends it first
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    host.arrivals.put(Arrival(7, (tokens, prompt, long, ChunkSchedule(1, 1, fixed=True)), own, 9003))
    wait(lambda: pipe.chunks(7), 30)
    host.channel.mark("cancel", 7)
    wait(lambda: (chunks := pipe.chunks(7)) and chunks[-1].last, 30)
    chunks = pipe.chunks(7)
    assert sum(c.last for c in chunks) == 1 and chunks[-1].finish_reason == CANCELLED
    assert sum(len(c.latents) for c in chunks) < 400  # ended early, not at max_patches
    assert own.responses == [(None, True)]
    wait(lambda: not host.service.live, 5)
    assert len(host.service.free) == 2 and not host.pipes.riding


def test_a_pipe_carries_its_streams_chunks_a_step_at_a_time(host, model):
    pipe = PipeSender()
    host.arrivals.put(PipeOpening(9000, pipe, None))
    ids = [201, 202, 203]  # 2 slots: two run together, the third after
    own = {i: PipeSender() for i in ids}
    for i in ids:
        host.arrivals.put(Arrival(i, inputs(model, seed=i), own[i], 9000))
    stray = PipeSender()
    host.arrivals.put(Arrival(204, inputs(model, seed=4), stray, 0x1234))
    for s in [*own.values(), stray]:
        assert s.done.wait(60)

    assert pipe.responses[0] == ([], False)  # the opening, answered at once
    assert not any(final for _, final in pipe.responses)  # the pipe stays open
    for i in ids:
        assert own[i].responses == [(None, True)]  # one final response without tensors
        chunks = pipe.chunks(i)
        same_as_alone(model, i, chunks)
        assert all(host.keys.sealed(c) for c in chunks)
    assert any(len({c.stream_id for c in chunks}) > 1 for chunks, _ in pipe.responses)  # a step's chunks together
    (refusal,) = stray.chunks()
    assert refusal.last and refusal.finish_reason.startswith(UNAVAILABLE) and "no pipe 1234" in refusal.finish_reason
    wait(lambda: not host.service.live and not host.pipes.riding)

    host.channel.mark("cancel", 9000)  # its reader closes it
    assert pipe.done.wait(10) and pipe.responses[-1] == (None, True)
    wait(lambda: not host.pipes.open)
    assert len(host.service.free) == 2


def test_a_pipe_whose_reader_is_behind_gets_what_waited_in_one_response(host, model):
    receipt = Receipts(host.channel.dir, "tts").open(9001)
    pipe = PipeSender()
    host.arrivals.put(PipeOpening(9001, pipe, host.receipts.entry(receipt.parameter)))
    own = {i: PipeSender() for i in (301, 302)}
    for i in own:
        host.arrivals.put(Arrival(i, inputs(model, seed=i), own[i], 9001))
    wait(lambda: host.pipes.unsent() and not host.service.live)  # both generated to their end, nothing read
    assert pipe.responses == [([], False)]
    for s in own.values():  # answered at admission, before any of their chunks went out (T28)
        assert s.done.is_set() and s.responses == [(None, True)]
    receipt.read()  # the reader reads the opening response
    wait(lambda: len(pipe.responses) == 2)  # everything that waited, in one response
    for i in own:
        same_as_alone(model, i, pipe.chunks(i))
    assert host.pipes.unsent() == 0 and not host.pipes.riding


def test_a_pipe_that_cannot_send_loses_its_streams(host, model):
    pipe = PipeSender()
    host.arrivals.put(PipeOpening(9002, pipe, None))
    wait(lambda: pipe.responses)
    pipe.broken = True  # its reader is gone
    own = PipeSender()
    long = GenerationParams(seed=1, max_patches=400, min_patches=400)
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    host.arrivals.put(Arrival(401, (tokens, prompt, long, ChunkSchedule(1, 1, fixed=True)), own, 9002))
    assert own.done.wait(30) and own.responses == [(None, True)]  # admitted: answered at once
    wait(lambda: host.channel.take("lost", 401), 30)  # its tts hears it was lost (serving.stub.pipe_reader)
    wait(lambda: not host.pipes.open and not host.service.live and not host.pipes.riding, 10)
    assert len(host.service.free) == 2


def test_a_held_stream_is_not_stepped_and_keeps_its_slot(host, model):
    """tts holds a stream on its board (serving.flow.pacing, serving.flow.receipts): the engine steps the
    others, not it; it keeps its slot until released, then carries on as if never held; a held stream still
    ends when cancelled."""
    receipts, pipe = Receipts(host.channel.dir, "tts"), PipeSender()
    pipe.reader = receipts.open(9100)  # a reader that reads each response at once
    host.arrivals.put(PipeOpening(9100, pipe, host.receipts.entry(pipe.reader.parameter)))
    receipts.hold(301)  # held before it is admitted (a stream opened while its request is paused)
    for i in (301, 302):
        host.arrivals.put(Arrival(i, inputs(model, seed=i), PipeSender(), 9100))
    wait(lambda: any(c.last for c in pipe.chunks(302)))
    assert pipe.chunks(301) == [] and 301 in host.service.live and len(host.service.free) == 1
    receipts.release(301)
    wait(lambda: any(c.last for c in pipe.chunks(301)))
    same_as_alone(model, 301, pipe.chunks(301))
    receipts.hold(303)
    host.arrivals.put(Arrival(303, inputs(model, seed=3), PipeSender(), 9100))
    wait(lambda: 303 in host.service.live)
    host.channel.mark("cancel", 303)
    wait(lambda: any(c.last for c in pipe.chunks(303)))
    assert pipe.chunks(303)[-1].finish_reason == CANCELLED and pipe.chunks(303)[:-1] == []
    wait(lambda: not host.service.live)
    assert len(host.service.free) == 2
