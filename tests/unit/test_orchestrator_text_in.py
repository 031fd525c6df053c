"""The orchestrator's text-in path (no server): text that arrives in pieces is spoken as the front end cuts
it, each segment as soon as it is cut, and sounds exactly as the whole text would with the same segments."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.frontend import prepare
from engine.orchestrator import TextPiece, Utterance
from engine.params import GenerationParams
from engine.segments import FADE_SAMPLES
from tests.reference import reference_audio, reference_long
from tests.unit.test_orchestrator import NOSTOP, ONES, Pipeline, collect

FIRST = "The first sentence is long enough here."
SECOND = " And a second sentence comes after it."
TEXT = FIRST + SECOND
PARAMS = GenerationParams(seed=3, min_patches=5, max_patches=5)
FIXED = ChunkSchedule(1, 2, fixed=True)  # the deadline rule would size chunks by the clock
SPLIT = 8  # each sentence of TEXT its own segment, for the whole text and for each sentence alike


async def source(pieces, flush_after=()):
    for i, text in enumerate(pieces):
        yield TextPiece(text, flush=i in flush_after)
        await asyncio.sleep(0)


def words(text: str) -> list[str]:
    """``text`` in pieces as an LLM streams it: each word with the space before it."""
    parts = text.split(" ")
    return [parts[0]] + [" " + w for w in parts[1:]]


def count(model):
    return lambda t: len(model.models.tokenizer.encode(t))


def test_the_cut_is_the_whole_texts(model):
    """What the equality below rests on: each sentence alone makes the segment the whole text makes of it."""
    for max_patches in (400, PARAMS.max_patches):  # 5 patches also cut each sentence (engine.frontend.sentences)
        whole = prepare(TEXT, None, count(model), SPLIT, max_patches=max_patches).segments
        alone = [s for part in (FIRST, SECOND) for s in prepare(part, None, count(model), SPLIT,
                                                                  max_patches=max_patches).segments]  # fmt: skip
        assert len(whole) >= 2 and whole == alone


@pytest.mark.parametrize("release, flush_after", [("sentence", ()), ("flush", (6,))])
def test_text_word_by_word_equals_the_whole_text(model, release, flush_after):
    """Words one by one (cut at the sentence end, or by a flush after its last word) -> the whole text's
    audio, bit for bit, and the reference's segments joined by the cross-fade."""
    assert "".join(words(TEXT)[:7]) == FIRST
    p = Pipeline(model)
    utterance = Utterance("", params=PARAMS, schedule=FIXED, split_tokens=SPLIT)
    pieces = collect(p.orchestrator.run_text(utterance, None, source(words(TEXT), flush_after), release))
    assert pieces[-1].final and pieces[-1].finish_reason == "length"
    got = np.concatenate([piece.audio for piece in pieces])
    whole = collect(p.orchestrator.run(Utterance(TEXT, params=PARAMS, schedule=FIXED, split_tokens=SPLIT)))
    assert np.array_equal(got, np.concatenate([piece.audio for piece in whole]))
    np.testing.assert_allclose(got, reference_long(model, TEXT, PARAMS, SPLIT), atol=1e-5)
    assert [piece.flushed for piece in pieces if piece.flushed] == ([1] if flush_after else [])
    assert p.live == (0, 0)


def test_a_flush_mark_follows_the_audio_of_its_text(model):
    """Flushed(1) comes once the first segment's audio is out but the 50 ms the cross-fade holds; random
    piece sizes change nothing."""
    p = Pipeline(model)
    cuts = [0, 5, 6, 19, 23, 39, 40, 52, 60, len(TEXT)]  # FIRST ends at 39
    pieces = [TEXT[a:b] for a, b in itertools.pairwise(cuts)]
    utterance = Utterance("", params=PARAMS, schedule=FIXED, split_tokens=SPLIT)
    out = collect(p.orchestrator.run_text(utterance, None, source(pieces, flush_after=(4,))))
    marks = [i for i, piece in enumerate(out) if piece.flushed]
    assert [out[i].flushed for i in marks] == [1] and not out[marks[0]].audio.size
    before = sum(piece.audio.size for piece in out[: marks[0]])
    # the first sentence's segments (max_patches 5 cuts it), joined by the fade, but the fade held at its end
    segments = prepare(FIRST, None, count(model), SPLIT, max_patches=PARAMS.max_patches).segments
    joined = sum(reference_audio(model, s, PARAMS).size for s in segments) - (len(segments) - 1) * FADE_SAMPLES
    assert before == joined - FADE_SAMPLES
    whole = collect(p.orchestrator.run(Utterance(TEXT, params=PARAMS, schedule=FIXED, split_tokens=SPLIT)))
    assert np.array_equal(np.concatenate([piece.audio for piece in out]),
                          np.concatenate([piece.audio for piece in whole]))  # fmt: skip
    assert p.live == (0, 0)


def test_the_first_segment_speaks_while_later_text_is_still_coming(model):
    """The rest of the second sentence is only sent once audio of the first has come out (its first word
    confirms the first sentence's end): were a segment to wait for the text's end, this would never finish
    (the wait is bounded, to fail instead of hanging)."""
    p = Pipeline(model)
    heard, events = asyncio.Event(), []
    pieces = words(TEXT)

    async def llm():
        for piece in pieces[:8]:  # the first sentence, then " And"
            events.append("text")
            yield TextPiece(piece)
        await heard.wait()
        events.append("second sentence")
        yield TextPiece("".join(pieces[8:]))

    async def go():
        utterance = Utterance("", params=PARAMS, schedule=FIXED, split_tokens=SPLIT)
        async for piece in p.orchestrator.run_text(utterance, None, llm(), "sentence"):
            if piece.audio.size:
                events.append("audio")
                heard.set()

    asyncio.run(asyncio.wait_for(go(), 120))
    assert events.index("audio") < events.index("second sentence") < len(events) - 1
    assert p.live == (0, 0)


def test_cancelling_mid_segment_frees_everything_and_stops_reading(model):
    p = Pipeline(model)
    read = []

    async def endless():
        for i in range(10_000):
            read.append(i)
            yield TextPiece("Say this again. " if i == 0 else "More. ")
            await asyncio.sleep(0.01)

    async def go():
        started = asyncio.Event()

        async def consume():
            utterance = Utterance("", params=GenerationParams(seed=1, **NOSTOP), schedule=ONES)
            async for _ in p.orchestrator.run_text(utterance, None, endless(), "sentence"):
                started.set()
                await asyncio.sleep(0)  # the local generator steps on this loop: let the test look

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
        seen = len(read)
        await asyncio.sleep(0.05)
        assert len(read) == seen  # nothing reads the text any more

    asyncio.run(go())
    assert p.live == (0, 0)


def test_a_failing_text_source_ends_the_utterance_and_frees_everything(model):
    p = Pipeline(model)

    async def broken():
        yield TextPiece("A whole sentence first. ")
        await asyncio.sleep(0.05)
        raise ValueError("TEXT: too much text for one stream")

    utterance = Utterance("", params=GenerationParams(seed=1, min_patches=30, max_patches=30), schedule=ONES)
    with pytest.raises(ValueError, match="too much text"):
        collect(p.orchestrator.run_text(utterance, None, broken(), "sentence"))
    assert p.live == (0, 0)


def test_a_stream_with_nothing_to_speak_ends_with_no_audio(model):
    p = Pipeline(model)
    pieces = collect(p.orchestrator.run_text(Utterance(""), None, source([" ", " 😀 "], flush_after=(0,))))
    assert [piece.flushed for piece in pieces[:-1]] == [1]
    assert pieces[-1].final and pieces[-1].finish_reason == "stop" and not pieces[-1].audio.size
    assert p.live == (0, 0)


def test_an_edit_takes_no_text_stream(model):
    p = Pipeline(model)
    with pytest.raises(ValueError, match="no text stream"):
        collect(
            p.orchestrator.run_text(
                Utterance("", task="semantic_edit", instruction="Replace cats with dogs."), None, source([])
            )
        )
    assert p.live == (0, 0)
