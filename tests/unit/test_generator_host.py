"""The generator's engine thread (serving.stub.generator_host) with the tiny checkpoint, no Triton: response
senders and metrics are recorders. Every arrival ends with exactly one final response, slots come back,
a stream whose caller asked to stop (before or after it got a slot) ends cancelled, an id in use is
refused without disturbing its stream, and a stream whose responses cannot go out is freed and marked
lost. The stream's chunks are what the same stream gives alone, in-process (engine.streams)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.params import GenerationParams
from engine.protocol import CANCELLED, LENGTH, STOP
from engine.streams import GeneratorService
from serving.config.model_options import GeneratorOptions
from serving.security.auth import INTERNAL_KEY_ENV
from serving.stub.generator_host import Arrival, GeneratorHost

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


class Sender:
    """A response sender that records chunks; ``broken``: every send raises, as for a caller that is gone."""

    def __init__(self, broken: bool = False):
        self.chunks, self.broken, self.done = [], broken, threading.Event()

    def send(self, chunk):
        if self.broken:
            raise RuntimeError("the request is gone")
        self.chunks.append(chunk)
        if chunk.last:
            self.done.set()

    def finals(self) -> int:
        return sum(c.last for c in self.chunks)


@pytest.fixture
def host(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv(INTERNAL_KEY_ENV, "k" * 32)
    opts = GeneratorOptions(checkpoint=str(tiny_ckpt), device="cpu", run_dir="", cancel_dir=str(tmp_path),
                            slots=2, max_len=512, kv_memory_gb=0.0, attention="sdpa", synthetic_math=False,
                            models="")  # fmt: skip
    h = GeneratorHost(FakePb, opts, lambda sender, chunk: sender.send(chunk))
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


def test_every_arrival_ends_once_and_every_slot_comes_back(host, model):
    ids = [101, 102, 103, 104, 105]
    senders = {i: Sender(broken=i == 104) for i in ids}
    host.channel.mark_cancelled(105)  # its caller left before it got one of the 2 slots
    for i in ids:
        host.submit(Arrival(i, inputs(model, seed=i), senders[i]))
    deadline = time.monotonic() + 30
    while 101 not in host.service.live and not senders[101].done.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    duplicate = Sender()
    host.submit(Arrival(101, inputs(model, seed=1), duplicate))  # an id in use (if 101 still runs)
    for s in [*(senders[i] for i in ids if i != 104), duplicate]:
        assert s.done.wait(60)
    deadline = time.monotonic() + 10
    while host.service.live and time.monotonic() < deadline:
        time.sleep(0.01)

    assert all(s.finals() == 1 and s.chunks[-1].last for s in (*senders.values(), duplicate) if s.chunks)
    for i in (101, 102, 103):  # complete, sealed, and as the stream is alone in-process
        chunks, want = senders[i].chunks, alone(model, i)
        assert [(len(c.latents), c.finish_reason) for c in chunks] == [(len(c.latents), c.finish_reason) for c in want]
        assert chunks[-1].finish_reason in (LENGTH, STOP) and sum(len(c.latents) for c in chunks) >= 6
        assert all(host.keys.sealed(c) and c.stream_id == i for c in chunks)
        got, expected = (np.concatenate([c.latents for c in x]) for x in (chunks, want))
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [c.finish_reason for c in senders[105].chunks] == [CANCELLED]
    assert host.channel.take_lost(104) and not senders[104].chunks  # its tts hears it was lost
    if duplicate.chunks[-1].finish_reason not in (LENGTH, STOP):  # 101 was still live: refused, 101 undisturbed
        assert duplicate.finals() == 1 and "in use" in duplicate.chunks[-1].finish_reason
    assert not host.service.live and len(host.service.free) == 2 and not host.waiting
    assert not host.outboxes and not host.held


def test_a_live_stream_whose_caller_leaves_ends_cancelled(host, model):
    sender = Sender()
    long = GenerationParams(seed=1, max_patches=400, min_patches=400)  # the stop head never ends it first
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    host.submit(Arrival(7, (tokens, prompt, long, ChunkSchedule(1, 1, fixed=True)), sender))
    deadline = time.monotonic() + 30
    while not sender.chunks:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    host.channel.mark_cancelled(7)
    assert sender.done.wait(30)
    assert sender.finals() == 1 and sender.chunks[-1].finish_reason == CANCELLED
    assert sum(len(c.latents) for c in sender.chunks) < 400  # ended early, not at max_patches
    deadline = time.monotonic() + 5
    while host.service.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not host.service.live and len(host.service.free) == 2
