"""Text in as an LLM writes it (engine/frontend/text_in.py): pieces with flushes come out as the front end's
segments; a flush is a hard boundary; sentence release finds, before cleaning, the sentence ends that the
front end's splitter finds after it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.frontend import prepare
from engine.frontend.cleaning import clean
from engine.frontend.sentences import split_sentences
from engine.frontend.text_in import MAX_PENDING_CHARS, TextInSegmenter, last_sentence_end


def words(text: str) -> int:
    return len(text.split())


PROPERTIES = settings(deadline=None, max_examples=150)
# words an LLM writes, numbers with dots among them (not sentence ends); no mark inside a word but those
word = st.sampled_from(["the", "Booking", "is", "on", "3.5", "v1.8", "Monday", "you", "OK", "fine", "a", "b"])
# a sentence's end as written -> as the front end keeps it (the reference drops a mark right after another)
MARKS = {".": ".", "?": "?", "!": "!", ";": ";", "...": ".", "?!": "?", '."': '."', "!!!": "!"}
# (the sentence as written, as the front end says it)
sentence = st.builds(lambda ws, m: (" ".join(ws) + m, " ".join(ws) + MARKS[m]),
                     st.lists(word, min_size=1, max_size=8), st.sampled_from(sorted(MARKS)))  # fmt: skip
sentences = st.lists(sentence, min_size=1, max_size=6)


def pieces(text: str) -> list[str]:
    """``text`` word by word as a streaming LLM sends it: each word with the space before it."""
    first, *rest = text.split(" ")
    return [first] + [" " + w for w in rest]


def feed(segmenter: TextInSegmenter, sentence_list: list[str], flush_each: bool) -> list[str]:
    out = []
    for i, s in enumerate(sentence_list):
        for piece in pieces(s if i == 0 else " " + s):
            if piece:
                out += segmenter.push(piece)
        if flush_each:
            out += segmenter.flush()
    return out + segmenter.end()


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("Hello there. It costs $12.50 at 10:30; see **Dr. Smith** 😀. " * 6, "English"),
        ("This is a long one; it has many clauses, and no end " * 30, "English"),
        ("今天天气很好。我们去公园散步吧！你觉得怎么样？" * 4, None),
        ("Bonjour à tous. Comment allez-vous?", "auto"),
    ],
)
def test_a_whole_text_at_once_is_prepares_segments(text, language):
    segmenter = TextInSegmenter(language, words, split_tokens=20, max_patches=60)
    assert segmenter.push(text) == []  # held until the flush
    prepared = prepare(text, language, words, split_tokens=20, max_patches=60)
    assert segmenter.end() == prepared.segments and segmenter.language == prepared.language
    assert len(prepared.segments) > 1 or "Bonjour" in text


@PROPERTIES
@given(sentences)
def test_word_by_word_with_a_flush_at_each_sentence_end_is_one_segment_a_sentence(sentence_list):
    segmenter = TextInSegmenter("English", words, split_tokens=2, normalize=False)
    written = [w for w, _ in sentence_list]
    assert feed(segmenter, written, flush_each=True) == [spoken for _, spoken in sentence_list]


@PROPERTIES
@given(sentences)
def test_sentence_release_finds_the_splitters_ends_before_cleaning(sentence_list):
    """Without any flush, sentence release gives what flushing after each sentence gives, and those are
    the front end's own sentences of the whole text (split_sentences after cleaning, runs of marks made one)."""
    written = [w for w, _ in sentence_list]
    released = feed(TextInSegmenter("English", words, normalize=False, release="sentence"), written, False)
    flushed = feed(TextInSegmenter("English", words, normalize=False), written, flush_each=True)
    assert released == flushed
    text = " ".join(written)
    assert released == [clean(s) for s in split_sentences(clean(text))]


@PROPERTIES
@given(sentences)
def test_character_by_character_is_word_by_word(sentence_list):
    """Each sentence end is settled by the character after it (3.5, ?!, a closing quote), whatever the pieces."""
    written = [w for w, _ in sentence_list]
    text = " ".join(written)
    segmenter = TextInSegmenter("English", words, normalize=False, release="sentence")
    by_character = [s for c in text for s in segmenter.push(c)] + segmenter.end()
    by_word = feed(TextInSegmenter("English", words, normalize=False, release="sentence"), written, False)
    assert by_character == by_word


def test_a_flush_is_a_hard_boundary_where_the_grouping_would_join():
    """split_tokens groups short sentences of one unit (and a short last one joins the one before);
    a flush between them keeps them apart."""
    text = "Yes. I can do that. It is booked for Monday. Anything else?"
    assert prepare(text, "English", words, split_tokens=80).segments == [text]
    segmenter = TextInSegmenter("English", words)
    out = segmenter.push("Yes.") + segmenter.flush() + segmenter.push(" I can do that.") + segmenter.flush()
    assert out == ["Yes.", "I can do that."]
    assert segmenter.push(" It is booked for Monday. Anything else?") + segmenter.end() == [
        "It is booked for Monday. Anything else?"
    ]


def test_a_sentence_longer_than_the_cap_is_still_cut():
    long = " ".join(["word"] * 50) + "."
    segmenter = TextInSegmenter("English", words, split_tokens=10, max_patches=20, release="sentence")
    out = segmenter.push(long + " ") + segmenter.end()
    assert len(out) == 5 and all(words(s) <= 10 for s in out)


def test_the_language_is_detected_once():
    segmenter = TextInSegmenter(None, len, release="sentence")
    assert segmenter.push("今天天气很好。") == [] and segmenter.language is None  # the end is not settled
    assert segmenter.push("Hello") == ["今天天气很好。"] and segmenter.language == "Chinese"
    assert segmenter.end() and segmenter.language == "Chinese"


@pytest.mark.parametrize(
    ("text", "end"),
    [("Hello there. How", 12), ("Pi is 3.", 0), ("Pi is 3.5 ok", 0), ("Wait... what", 7), ("Wait...", 0),
     ('He said "Hi." and', 13), ("你好。我", 3), ("你好。", 0), ("Really?! Yes", 8), ("e.g. this", 4)],
)  # fmt: skip
def test_sentence_ends_in_raw_text(text, end):
    assert last_sentence_end(text) == end


def test_nothing_to_say_and_the_bounds():
    segmenter = TextInSegmenter("English", words)
    assert segmenter.push(" ") == [] and segmenter.flush() == []  # LiveKit ends a context with a lone space
    assert segmenter.push("😀 **") == [] and segmenter.flush() == []
    with pytest.raises(ValueError, match="without a flush"):
        segmenter.push("x" * (MAX_PENDING_CHARS + 1))
    assert segmenter.end() == []
    with pytest.raises(ValueError, match="ended"):
        segmenter.push("more")
    with pytest.raises(ValueError, match="release"):
        TextInSegmenter("English", words, release="token")
