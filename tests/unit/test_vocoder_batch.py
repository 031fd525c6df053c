"""Vocoder requests carrying a batch of chunks (serving.stub.vocoder_batch), without a server: tts's decode
calls that come together go out as one request per shape, and each chunk's answer reaches its own caller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from engine.protocol import Chunk, StreamFailed, end_chunk
from serving import contract
from serving.stub.triton_io import read_chunk
from serving.stub.vocoder_batch import BLSVocoder, answer, request_values, rows, split


def chunk(sid: int, rows_: int, prompt: int = 0, seq: int = 1) -> Chunk:
    lat = np.full((rows_, 64), sid, np.float32)
    return Chunk(sid, lat, np.ones((prompt, 64), np.float32), seq=seq, seal=sid * 7)


class FakeVocoder:
    """Stands in for BLS to the vocoder: answers each row with its stream id repeated once per latent;
    refuses stream 666; the whole request fails when it holds stream 999."""

    def __init__(self):
        self.requests: list[list[int]] = []
        self.pb = SimpleNamespace(Tensor=lambda name, value: (name, value))

    async def call(self, model, inputs, outputs, decoupled=False):
        values = dict(inputs)
        assert model == "vocoder" and decoupled and set(outputs) == {s.name for s in contract.VOCODER_OUTPUTS}
        got = [read_chunk(t) for t in rows(values.get)]
        self.requests.append([c.stream_id for c in got])
        if any(c.stream_id == 999 for c in got):
            raise TimeoutError("vocoder did not answer within 30 s")
        await asyncio.sleep(0)
        return answer([(None, "invalid: unknown stream") if c.stream_id == 666 else
                       (np.full(len(c.latents), c.stream_id, np.float32), c.finish_reason) for c in got])  # fmt: skip


def run(coro):
    return asyncio.run(coro)


def test_rows_read_back_the_chunks_they_were_made_of():
    sent = [chunk(1, 8, seq=0, prompt=4), chunk(2, 8, seq=0, prompt=4)]
    values = request_values(sent)
    assert values["LATENTS"].shape == (2, 8, 64) and values["SEAL"].shape == (2, 2)
    got = [read_chunk(t) for t in rows(values.get)]
    for a, b in zip(sent, got, strict=True):
        assert (a.stream_id, a.seq, a.seal, a.last) == (b.stream_id, b.seq, b.seal, b.last)
        assert a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.latents, b.latents)
        np.testing.assert_array_equal(a.prompt_latents, b.prompt_latents)
    with pytest.raises(ValueError, match="one row per chunk"):
        rows({**values, "LAST": values["LAST"][:1]}.get)


def test_request_values_are_each_chunks_own_tensors_stacked():
    """The column-at-a-time build gives exactly the arrays of the spec's per-chunk conversion, stacked."""
    rng = np.random.default_rng(0)
    for rows_, prompt in [(4, 0), (0, 0), (1, 22), (12, 0)]:
        chunks = [Chunk(int(rng.integers(1, 2**63)), rng.standard_normal((rows_, 64)).astype(np.float32),
                        rng.standard_normal((prompt, 64)).astype(np.float32), last=bool(i % 2),
                        finish_reason=["", "stop", "invalid: \u00e9t\u00e9"][i % 3], seq=i, seal=2**64 - 1 - i)
                  for i in range(5)]  # fmt: skip
        got = request_values(chunks)
        for spec in contract.VOCODER_INPUTS:
            one = {"STREAM_ID": lambda c: c.stream_id, "LATENTS": lambda c: c.latents,
                   "PROMPT_LATENTS": lambda c: c.prompt_latents, "LAST": lambda c: c.last,
                   "FINISH_REASON": lambda c: c.finish_reason, "SEAL": lambda c: (c.seq, c.seal)}[spec.name]  # fmt: skip
            expected = np.stack([spec.array(one(c)) for c in chunks])
            assert got[spec.name].dtype == expected.dtype and got[spec.name].shape == expected.shape, spec.name
            assert (got[spec.name] == expected).all(), spec.name


def test_answers_pad_audio_and_say_each_rows_length():
    out = answer([(np.ones(3, np.float32), ""), (None, "invalid: no"), (np.ones(1, np.float32), "length")])
    assert out["AUDIO"].shape == (3, 3) and out["SAMPLES"].reshape(-1).tolist() == [3, 0, 1]
    last = Chunk(3, np.zeros((1, 64), np.float32), np.zeros((0, 64), np.float32), True, "length")
    chunks = [chunk(1, 1), chunk(2, 1), last]
    got = split(out, chunks)
    assert got[0].tolist() == [1, 1, 1] and isinstance(got[1], StreamFailed) and got[2].tolist() == [1]


def test_decodes_that_come_together_go_out_as_one_request_per_shape():
    fake = FakeVocoder()
    vocoder = BLSVocoder(fake, most=3)

    async def go():
        same = [vocoder.decode(chunk(sid, 8)) for sid in (1, 2, 3, 4)]  # 4 alike: 3 + 1 (at most 3 a request)
        other = [vocoder.decode(chunk(5, 4)), vocoder.decode(chunk(6, 8, prompt=4, seq=0))]
        return await asyncio.gather(*same, *other)

    got = run(go())
    assert [a.tolist() for a in got] == [[sid] * n for sid, n in ((1, 8), (2, 8), (3, 8), (4, 8), (5, 4), (6, 8))]
    assert sorted(fake.requests) == [[1, 2, 3], [4], [5], [6]]


def test_the_decodes_one_turn_wakes_go_out_together_and_a_later_turn_sends_its_own():
    """A pipe response wakes its streams in one turn (serving.stub.pipe_reader._deliver): their decodes make
    one request, sent at the end of the next turn; a decode of a later turn waits on no timer for more."""
    fake = FakeVocoder()
    vocoder = BLSVocoder(fake, most=64)

    async def stream(sid: int, woken: asyncio.Future):
        await woken
        return await vocoder.decode(chunk(sid, 8))

    async def go():
        loop = asyncio.get_running_loop()
        woken = [loop.create_future() for _ in range(3)]
        tasks = [asyncio.ensure_future(stream(sid, w)) for sid, w in zip((1, 2, 3), woken, strict=True)]
        await asyncio.sleep(0)  # every stream waits for its chunk
        loop.call_soon(lambda: [w.set_result(None) for w in woken])  # one pipe response, one callback
        first = await asyncio.gather(*tasks)
        return first, await vocoder.decode(chunk(4, 8))

    first, later = run(go())
    assert [a[0] for a in first] == [1, 2, 3] and later[0] == 4
    assert fake.requests == [[1, 2, 3], [4]]


def test_a_refused_chunk_fails_its_own_stream_and_a_failed_request_its_own_chunks():
    fake = FakeVocoder()
    vocoder = BLSVocoder(fake, most=8)

    async def go():
        calls = [vocoder.decode(chunk(sid, 8)) for sid in (1, 666, 2)] + [vocoder.decode(chunk(999, 4))]
        calls.append(vocoder.decode(end_chunk(3)))  # an ending chunk: no latents, its own shape
        return await asyncio.gather(*calls, return_exceptions=True)

    one, refused, two, timed_out, ended = run(go())
    assert one.tolist() == [1] * 8 and two.tolist() == [2] * 8 and ended.size == 0
    assert isinstance(refused, StreamFailed) and "unknown stream" in str(refused)
    assert isinstance(timed_out, TimeoutError)
    assert len(fake.requests) == 3


def test_a_cancelled_caller_leaves_the_others_their_answers():
    fake = FakeVocoder()
    vocoder = BLSVocoder(fake, most=8)

    async def go():
        leaving = asyncio.ensure_future(vocoder.decode(chunk(1, 8)))
        staying = asyncio.ensure_future(vocoder.decode(chunk(2, 8)))
        await asyncio.sleep(0)
        leaving.cancel()
        return await staying

    assert run(go()).tolist() == [2] * 8
    assert fake.requests == [[1, 2]]  # the leaving caller's chunk was sent all the same (the stream's order)
