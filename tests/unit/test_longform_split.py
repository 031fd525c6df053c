"""client.longform's rule for long text: parts within the bound, cut at paragraphs, then sentences, then
clauses, then spaces, nothing but whitespace dropped, and what no boundary can cut refused by name."""

from __future__ import annotations

import random

import numpy as np
import pytest

from client.longform import JOIN_SILENCE_SECONDS, Unsplittable, joined, split_text
from engine.protocol import SAMPLE_RATE
from serving.contract import MAX_TEXT_CHARS


def letters(text: str) -> str:
    return "".join(text.split())


def test_a_text_within_the_bound_is_one_part_as_it_was():
    assert split_text("  Hello there. How are you?\n", 100) == ["Hello there. How are you?"]


def test_paragraphs_are_packed_whole_before_any_is_cut():
    text = "First one. Still first.\n\nSecond paragraph.\n\n\n  Third."
    assert split_text(text, 45) == ["First one. Still first.\n\nSecond paragraph.", "Third."]
    assert split_text(text, 30) == ["First one. Still first.", "Second paragraph.\n\nThird."]


def test_a_long_paragraph_is_cut_at_sentences_then_clauses_then_spaces():
    assert split_text("One two. Three four! Five six?", 12) == ["One two.", "Three four!", "Five six?"]
    assert split_text("alpha beta, gamma delta: epsilon", 12) == ["alpha beta,", "gamma delta:", "epsilon"]
    assert split_text("aaa bbb ccc ddd", 7) == ["aaa bbb", "ccc ddd"]
    assert split_text("你好。世界！好的", 4) == ["你好。", "世界！", "好的"]


def test_random_texts_keep_every_character_in_order_and_every_part_within_the_bound():
    rng = random.Random(5)
    words = ["a", "word", "longerword", "x" * 25, "end.", "stop!", "what?", "comma,", "\n\n", "\n", "semi;"]
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 300)))
        if not text.strip():
            continue
        bound = rng.choice([25, 40, 100, 1000])
        parts = split_text(text, bound)
        assert all(1 <= len(p) <= bound and p == p.strip() for p in parts), (bound, parts)
        assert letters("".join(parts)) == letters(text)  # nothing dropped, nothing added, in order


def test_what_no_boundary_cuts_is_refused_by_name_never_truncated():
    with pytest.raises(Unsplittable, match="30 characters without a space at character 4"):
        split_text("ok. " + "z" * 30, 20)
    with pytest.raises(ValueError, match="the text is empty"):
        split_text(" \n\n ", 20)
    with pytest.raises(ValueError, match=f"1..{MAX_TEXT_CHARS}"):
        split_text("hi", MAX_TEXT_CHARS + 1)


def test_parts_are_joined_in_order_with_the_stated_silence_between_two():
    a, b = np.full(10, 0.5, np.float32), np.full(7, -0.5, np.float32)
    gap = round(JOIN_SILENCE_SECONDS * SAMPLE_RATE)
    out = joined([a, b])
    assert out.size == 17 + gap and np.all(out[:10] == 0.5) and np.all(out[10:-7] == 0) and np.all(out[-7:] == -0.5)
    assert np.array_equal(joined([a]), a)  # one part: exactly its audio
