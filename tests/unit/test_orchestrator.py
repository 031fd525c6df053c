"""The orchestrator's cancel, error and cleanup paths, in-process (no server): whatever ends an
utterance, every generator slot and every vocoder stream it opened is freed."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.local import LocalGenerator, LocalPrompts, LocalVocoder
from engine.orchestrator import Orchestrator, Utterance
from engine.params import GenerationParams
from engine.protocol import SAMPLE_RATE, StreamFailed
from engine.time_stretch import TimeStretch
from tests.reference import reference_audio


class FailingVocoder(LocalVocoder):
    """Fails the n-th chunk it is given (the one after is served again)."""

    def __init__(self, model, fail_at: int):
        super().__init__(model)
        self.calls, self.fail_at = 0, fail_at

    async def decode(self, chunk):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("vocoder broke")
        return await super().decode(chunk)


class Pipeline:
    def __init__(self, model, vocoder=None):
        self.generator = LocalGenerator(model, slots=2, max_len=1024)
        self.vocoder = vocoder or LocalVocoder(model)
        self.orchestrator = Orchestrator(LocalPrompts(model), self.generator, self.vocoder,
                                         lambda t: len(model.models.tokenizer.encode(t)))  # fmt: skip

    @property
    def live(self) -> tuple[int, int]:
        """(generator slots in use, vocoder streams with state)"""
        return self.generator.service.active if self.generator.service else 0, self.vocoder.service.active


def collect(pieces, stop_after=None):
    async def go():
        got = []
        async with __import__("contextlib").aclosing(pieces) as it:
            async for piece in it:
                got.append(piece)
                if stop_after is not None and len(got) >= stop_after:
                    break
        return got

    return asyncio.run(go())


NOSTOP = dict(min_patches=40, max_patches=40)
ONES = ChunkSchedule(1, 1, fixed=True)  # a chunk per patch: these tests count chunks


def test_a_whole_run_equals_the_reference_and_frees_everything(model):
    p = Pipeline(model)
    params = GenerationParams(seed=2, min_patches=9, max_patches=9)
    pieces = collect(p.orchestrator.run(Utterance("Orchestrated", params=params)))  # the default: the deadline rule
    assert pieces[-1].final and pieces[-1].finish_reason == "length"
    assert not any(piece.final for piece in pieces[:-1])
    got = np.concatenate([piece.audio for piece in pieces])
    np.testing.assert_allclose(got, reference_audio(model, "Orchestrated", params), atol=1e-5)
    assert p.live == (0, 0)


def test_closing_early_frees_the_slot_and_the_vocoder_stream(model):
    p = Pipeline(model)
    run = p.orchestrator.run(Utterance("Leaving early", params=GenerationParams(seed=1, **NOSTOP), schedule=ONES))
    got = collect(run, stop_after=2)
    assert len(got) == 2 and not got[-1].final
    assert p.live == (0, 0)


def test_task_cancellation_frees_everything(model):
    p = Pipeline(model)

    async def go():
        started = asyncio.Event()

        async def consume():
            async for _ in p.orchestrator.run(Utterance("Cancel me", params=GenerationParams(**NOSTOP), schedule=ONES)):
                started.set()
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        await started.wait()
        assert p.live == (1, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the cleanup is shielded: it finishes on the loop just after the task
            if p.live == (0, 0):
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert p.live == (0, 0)


def test_a_generator_rejection_is_invalid_input_and_leaks_nothing(model):
    p = Pipeline(model)
    with pytest.raises(StreamFailed, match="cache positions") as e:
        collect(p.orchestrator.run(Utterance("word " * 400, params=GenerationParams(max_patches=400), split_tokens=0)))
    assert e.value.invalid
    with pytest.raises(ValueError, match="Klingon"):  # the front end refuses it before any stream opens
        collect(p.orchestrator.run(Utterance("Hello", language="Klingon")))
    with pytest.raises(ValueError, match="TEXT: nothing to speak after cleaning"):
        collect(p.orchestrator.run(Utterance(" 😀 \u200b ")))
    assert p.live == (0, 0)


def test_a_vocoder_failure_closes_the_generator_stream(model):
    p = Pipeline(model, FailingVocoder(model, fail_at=3))
    with pytest.raises(RuntimeError, match="vocoder broke"):
        collect(p.orchestrator.run(Utterance("Breaks", params=GenerationParams(**NOSTOP), schedule=ONES)))
    assert p.live == (0, 0)


def test_a_failure_in_a_later_segment_frees_that_segment(model):
    """Segments run one after another; the vocoder breaks in the second and nothing stays behind."""
    p = Pipeline(model, FailingVocoder(model, fail_at=5))
    text = "The first sentence is long enough here. And a second sentence comes after it."
    params = GenerationParams(seed=3, min_patches=3, max_patches=3)
    with pytest.raises(RuntimeError, match="vocoder broke"):
        collect(p.orchestrator.run(Utterance(text, params=params, schedule=ONES, split_tokens=8)))
    assert p.live == (0, 0)


def test_concurrent_utterances_do_not_mix(model):
    """Two utterances interleaved on one event loop and one 2-slot generator equal their solo references."""
    p = Pipeline(model)
    texts, seeds = ["First voice", "Second voice here"], [4, 5]

    async def one(text, seed):
        params = GenerationParams(seed=seed, min_patches=7, max_patches=7)
        out = []
        async for piece in p.orchestrator.run(Utterance(text, params=params)):
            out.append(piece.audio)
            await asyncio.sleep(0)
        return np.concatenate(out), params

    async def both():
        return await asyncio.gather(*(one(t, s) for t, s in zip(texts, seeds, strict=True)))

    for (got, params), text in zip(asyncio.run(both()), texts, strict=True):
        np.testing.assert_allclose(got, reference_audio(model, text, params), atol=1e-5)
    assert p.live == (0, 0)


@pytest.mark.parametrize("speed", (0.5, 2.0))
def test_speed_stretches_the_utterance_as_it_streams(model, speed):
    """The pieces at ``speed`` are the speed-1.0 audio stretched as a whole (engine.time_stretch), bit for
    bit, across a segment join; every piece before the final one has audio, and the final one the rest."""
    p = Pipeline(model)
    text = "The first sentence is long enough here. And a second sentence comes after it."
    params = GenerationParams(seed=3, min_patches=5, max_patches=5)
    plain = Utterance(text, params=params, schedule=ChunkSchedule(1, 2, fixed=True), split_tokens=8)
    audio = np.concatenate([piece.audio for piece in collect(p.orchestrator.run(plain))])
    pieces = collect(p.orchestrator.run(dataclasses.replace(plain, speed=speed)))
    assert len(pieces) > 2 and pieces[-1].final and pieces[-1].finish_reason == "length"
    assert all(piece.audio.size and not piece.final for piece in pieces[:-1])
    whole = TimeStretch(speed)
    assert np.array_equal(np.concatenate([piece.audio for piece in pieces]),
                          np.concatenate([whole.push(audio), whole.finish()]))  # fmt: skip
    assert p.live == (0, 0)


def test_closing_a_stretched_run_early_frees_everything(model):
    p = Pipeline(model)
    utterance = Utterance("Leaving early", params=GenerationParams(seed=1, **NOSTOP), schedule=ONES, speed=1.5)
    got = collect(p.orchestrator.run(utterance), stop_after=2)
    assert len(got) == 2 and not got[-1].final
    assert p.live == (0, 0)


class RecordingGenerator(LocalGenerator):
    """Records each segment's chunk schedule and the audio the caller had received when it started."""

    def __init__(self, model, received: list):
        super().__init__(model, slots=1, max_len=1024)
        self.received, self.started = received, []

    def stream(self, segment):
        self.started.append((segment.schedule, sum(a.size for a in self.received)))
        return super().stream(segment)


@pytest.mark.parametrize("clock_step", [0.0, 10.0])
def test_a_later_segment_starts_from_what_the_listener_holds(model, clock_step):
    """A clock that stands still: the listener holds all the audio received when the second segment
    starts; one that jumps 10 s a reading: the listener ran dry, and the segment starts afresh."""
    received, readings = [], iter(range(1000))
    generator = RecordingGenerator(model, received)
    orchestrator = Orchestrator(LocalPrompts(model), generator, LocalVocoder(model),
                                lambda t: len(model.models.tokenizer.encode(t)),
                                clock=lambda: 100.0 + clock_step * next(readings))  # fmt: skip
    text = "The first sentence is long enough here. And a second sentence comes after it."
    utterance = Utterance(text, params=GenerationParams(seed=3, min_patches=5, max_patches=5), split_tokens=8)

    async def go():
        async for piece in orchestrator.run(utterance):
            received.append(piece.audio)

    asyncio.run(go())
    (first, _), *later = generator.started
    assert first == utterance.schedule and later  # the first segment: nothing held, nothing buffered
    for schedule, heard in later:
        held = heard / SAMPLE_RATE if clock_step == 0 else 0.0
        assert heard > 0 and schedule.buffered == pytest.approx(held)
        assert dataclasses.replace(schedule, buffered=0.0) == utterance.schedule


def test_the_front_end_runs_once_per_text_and_its_failures_again(model, monkeypatch):
    """The front end's result is kept per text and settings (a pure function): a repeated reply skips it,
    with the same audio; text with nothing to speak fails every time."""
    import engine.orchestrator as orchestrator

    calls = []

    def counted(*args):
        calls.append(args[0])
        return orchestrator_prepare(*args)

    orchestrator_prepare = orchestrator.prepare
    monkeypatch.setattr(orchestrator, "prepare", counted)
    p = Pipeline(model)
    params = GenerationParams(seed=2, min_patches=3, max_patches=3)
    first = collect(p.orchestrator.run(Utterance("Kept once", params=params)))
    again = collect(p.orchestrator.run(Utterance("Kept once", params=params)))
    np.testing.assert_array_equal(np.concatenate([x.audio for x in first]), np.concatenate([x.audio for x in again]))
    assert calls == ["Kept once"]
    collect(p.orchestrator.run(Utterance("Kept once", params=params, split_tokens=0)))  # other settings: again
    assert calls == ["Kept once"] * 2
    for _ in range(2):
        with pytest.raises(ValueError):
            collect(p.orchestrator.run(Utterance(" \u200b ", params=params)))
    assert calls == ["Kept once"] * 2 + [" \u200b "] * 2
    assert p.live == (0, 0)
