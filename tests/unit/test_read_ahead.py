"""Read-ahead (issue 46), in-process: a long text's later segments generate while an earlier one plays, and
the audio is the sequential audio bit for bit (Base and Instruct, streamed and whole); a read-ahead segment
never takes a slot a waiting start needs, and yields its own to one (and runs again: the same audio)."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.frontend import prepare
from engine.local import LocalGenerator, LocalPrompts, LocalVocoder
from engine.orchestrator import Orchestrator, Utterance
from engine.params import GenerationParams
from engine.segments import ahead_may_start, ahead_to_yield
from engine.synthesize import instruct_run, synthesize
from serving.flow.admission import Admission
from tests.unit.test_orchestrator import collect

TEXT = (
    "The first sentence is long enough here. And a second sentence comes after it. A third sentence, "
    "the last one, is long enough to stand on its own as well."
)  # (a short last one joins the one before)
SPLIT = 8  # each sentence its own segment
PARAMS = GenerationParams(seed=11, min_patches=10)  # (a small max_patches would cut the sentences further)
FIXED = ChunkSchedule(1, 1, fixed=True)  # a chunk per patch (the deadline rule would size chunks by the clock)


class Watched(LocalGenerator):
    """Counts each segment's admissions and the most streams live at once."""

    def __init__(self, model, slots: int):
        super().__init__(model, slots, max_len=1024)
        self.admitted: Counter = Counter()
        self.most = 0
        self.on_admit = self.admitted_one

    def admitted_one(self, segment, state) -> None:
        self.admitted[segment.text] += 1
        self.most = max(self.most, self.service.active)


class Contended(Watched):
    """A start waits for a slot each time a segment run ahead has made two chunks, until that segment yields."""

    def __init__(self, model, slots: int):
        super().__init__(model, slots)
        self.chunks: Counter = Counter()
        self.yielded: set[str] = set()

    def starts_waiting(self) -> int:
        return int(any(n >= 2 and text not in self.yielded for text, n in self.chunks.items()))

    async def stream(self, segment):
        try:
            async for chunk in super().stream(segment):
                if segment.ahead:
                    self.chunks[segment.text] += 1
                yield chunk
        finally:
            if segment.ahead and self.chunks[segment.text] >= 2:
                self.yielded.add(segment.text)


def sequential_texts(model) -> list[str]:
    texts = prepare(TEXT, None, lambda t: len(model.models.tokenizer.encode(t)), SPLIT).segments
    assert len(texts) == 3
    return texts


def run(model, generator, read_ahead: int, **kw):
    orchestrator = Orchestrator(LocalPrompts(model), generator, LocalVocoder(model),
                                lambda t: len(model.models.tokenizer.encode(t)), slots=generator)  # fmt: skip
    utterance = Utterance(TEXT, params=PARAMS, schedule=FIXED, split_tokens=SPLIT, read_ahead=read_ahead, **kw)
    return collect(orchestrator.run(utterance))


def test_the_rule_puts_a_waiting_start_first_and_read_ahead_yields():
    assert ahead_may_start(free=1, waiting=0)
    assert not ahead_may_start(free=1, waiting=1)  # the free slot is the waiting start's
    assert not ahead_may_start(free=0, waiting=0)
    assert ahead_to_yield(waiting=2, yielding=0, ahead=3) == 2  # one per waiting start
    assert ahead_to_yield(waiting=2, yielding=1, ahead=3) == 1  # one is on its way out already
    assert ahead_to_yield(waiting=3, yielding=0, ahead=1) == 1  # no more than run ahead
    assert ahead_to_yield(waiting=0, yielding=0, ahead=3) == 0


def test_generator_slots_admit_a_waiting_start_before_any_read_ahead(tmp_path):
    """tts's slot keeper, over the real shared files: read-ahead takes only a free slot nobody waits for."""

    async def main():
        tts, ensemble = Admission(tmp_path, "tts", 40, 2), Admission(tmp_path, "ensemble_generator", 40, 2)
        await tts.take_slot()  # a request's first segment
        assert tts.take_ahead() and tts.slots_held() == 2  # its second, ahead, on the free slot
        start = asyncio.ensure_future(ensemble.take_slot())  # another request's first segment waits ...
        await asyncio.sleep(0.1)
        assert not start.done() and tts.starts_waiting() == 1  # ... seen by every sender
        assert ahead_to_yield(tts.starts_waiting(), 0, 1) == 1  # so the read-ahead segment yields
        tts.give_slot()
        assert not tts.take_ahead()  # and no read-ahead takes the slot back while the start waits
        await asyncio.wait_for(start, 5)  # the start has it
        assert tts.starts_waiting() == 0 and tts.slots_held() == 2 and not tts.take_ahead()
        ensemble.give_slot()
        assert tts.take_ahead()

    asyncio.run(main())


def test_base_read_ahead_streams_the_sequential_audio_bit_for_bit(model):
    sequential = run(model, Watched(model, 1), 1)
    ahead = Watched(model, 3)
    pieces = run(model, ahead, 3)
    assert ahead.most >= 2 and ahead.admitted == Counter(sequential_texts(model))  # side by side, each once
    assert [p.audio.tobytes() for p in pieces] == [p.audio.tobytes() for p in sequential]  # piece by piece
    assert pieces[-1].final and pieces[-1].finish_reason == sequential[-1].finish_reason
    assert ahead.service.active == 0


def test_whole_offline_audio_is_the_same_with_read_ahead(model):
    kw = dict(params=PARAMS, split_tokens=SPLIT)
    assert synthesize(model, TEXT, read_ahead=3, **kw).tobytes() == synthesize(model, TEXT, **kw).tobytes()


def test_instruct_design_with_read_ahead_is_the_same(model):
    """Several segments of a voice design, each with its plan: the same plan, latents and audio."""
    kw = dict(split_tokens=SPLIT)
    one = instruct_run(model, "design", TEXT, "a calm older man", **kw)
    three = instruct_run(model, "design", TEXT, "a calm older man", read_ahead=3, **kw)
    assert len(one.latents) == 3 and one.plan_text == three.plan_text
    assert [x.tobytes() for x in three.latents] == [x.tobytes() for x in one.latents]
    assert three.audio.tobytes() == one.audio.tobytes()


@pytest.mark.parametrize("task", ["", "design"])
def test_read_ahead_yields_to_waiting_starts_and_runs_again_the_same(model, task):
    """Every segment run ahead is cancelled after two chunks for a start that waits, runs again from scratch
    later, and the audio is still the sequential audio; nothing is left open."""
    kw = dict(task=task, instruction="a calm older man") if task else {}
    sequential = run(model, Watched(model, 1), 1, **kw)
    contended = Contended(model, 3)
    pieces = run(model, contended, 3, **kw)
    assert contended.yielded and max(contended.admitted.values()) >= 2  # yielded, and ran again
    assert (
        np.concatenate([p.audio for p in pieces]).tobytes() == np.concatenate([p.audio for p in sequential]).tobytes()
    )
    assert contended.service.active == 0
