"""Control tokens of the tokenizer (``<|eot|>``, ``<|im_end|>``, ``<think>``...) in a client's text: refused on the
text as the tokenizer reads it (engine/frontend ``prepare``, after cleaning and normalization), however the
text was split or padded with invisible characters, and never encoded as their ids (engine/text.py).

The oracle is the tokenizer itself: an id at or past ``QWEN_FIRST_ID`` is an added token."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.frontend import prepare
from engine.frontend.text_in import TextInSegmenter
from engine.text import QWEN_FIRST_ID, TextTokenizer, format_prompt, write_tiny_tokenizer

PROPERTIES = settings(deadline=None, max_examples=150)
TOKENS = ("<|eot|>", "<|im_end|>", "<|sosp|>", "<|im_start|>", "<think>", "</tool_call>")
# characters cleaning removes: zero-width space, word joiner, BOM, soft hyphen, left-to-right mark, private use
INVISIBLE = ("\u200b", "\u2060", "\ufeff", "\u00ad", "\u200e", "\ue000")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    path: Path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path)
    return TextTokenizer.from_dir(path)


def tokens(text: str) -> int:
    return len(text.split())


def padded(token: str, filler: str) -> str:
    """``token`` with ``filler`` between each two of its characters."""
    return filler.join(token)


def added_ids(tok: TextTokenizer, segments: list[str]) -> list[int]:
    """The added-token ids the model would read in ``segments`` (Base prompts; the prompt's own three are not)."""
    return [i for s in segments for i in tok.encode_prompt(s, "English")[2:-1] if i >= QWEN_FIRST_ID]


@pytest.mark.parametrize("token", TOKENS)
@pytest.mark.parametrize("count", [1, 32, 40, 200])
def test_a_token_with_zero_width_spaces_inside_is_refused_by_name(token, count):
    text = f"Say {padded(token, chr(0x200B) * count)} now."
    with pytest.raises(ValueError) as raised:
        prepare(text, "English", tokens, normalize=False)
    assert str(raised.value).startswith("TEXT must not contain")
    assert repr(token) in str(raised.value)


@pytest.mark.parametrize("token", TOKENS)
def test_normalized_a_token_is_refused_or_no_longer_one(tok, token):
    # wetext's symbol clean-up drops "<" and "|": what is left is words, which the tokenizer reads as words
    try:
        segments = prepare(f"Say {padded(token, chr(0x200B) * 40)} now.", "English", tokens).segments
    except ValueError as e:
        assert str(e).startswith("TEXT must not contain")
    else:
        assert not added_ids(tok, segments)


@pytest.mark.parametrize("filler", INVISIBLE)
def test_every_invisible_character_that_cleaning_drops_is_seen_through(filler):
    with pytest.raises(ValueError, match="'<\\|eot\\|>'"):
        prepare(f"Hello {padded('<|eot|>', filler * 3)} world", "English", tokens, normalize=False)


@pytest.mark.parametrize("release", ["flush", "sentence"])
def test_a_token_split_across_text_in_pieces_is_refused(release):
    gap = "\u200b" * 40  # more than any look-back over the pieces as sent
    segmenter = TextInSegmenter("English", tokens, normalize=False, release=release)
    for piece in ["Hello <", gap, "|eot|", gap, "> world."]:
        segmenter.push(piece)  # no piece holds "<|" or "|>" as sent
    with pytest.raises(ValueError, match="^TEXT must not contain '<\\|': '<\\|eot\\|>'"):
        segmenter.end()


@pytest.mark.parametrize(
    "text", ["1 < 2 and 3 > 2.", "a|b, x<y, p>q", "Use the pipe | and the arrow ->.", "<b>bold</b>"]
)
def test_ordinary_text_with_the_same_characters_is_spoken(tok, text):
    segments = prepare(text, "English", tokens, normalize=False).segments
    assert segments and not added_ids(tok, segments)


@pytest.mark.parametrize("normalize", [False, True])
def test_fullwidth_forms_are_text_not_tokens(tok, normalize):
    # the tokenizer's normalizer is NFC, not NFKC, and added tokens are matched as written: ＜｜eot｜＞ is text
    segments = prepare("Say ＜｜eot｜＞ now.", "English", tokens, normalize=normalize).segments
    assert not added_ids(tok, segments)


@PROPERTIES
@given(
    token=st.sampled_from(TOKENS),
    fillers=st.lists(st.text(st.sampled_from(INVISIBLE), max_size=40), min_size=8, max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    normalize=st.booleans(),
)
def test_however_it_is_split_no_control_token_reaches_the_tokenizer(tok, token, fillers, cuts, normalize):
    text = "Hi " + "".join(c + f for c, f in zip(token, fillers, strict=False)) + " there."
    segmenter = TextInSegmenter("English", tokens, normalize=normalize)
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    try:
        for start, end in zip(bounds, bounds[1:], strict=False):
            segmenter.push(text[start:end])
        segments = segmenter.end()
    except ValueError as e:
        assert str(e).startswith("TEXT must not contain")
    else:
        assert not added_ids(tok, segments)


def test_the_prompt_encodes_a_token_in_the_clients_text_as_text(tok):
    ids = tok.encode_prompt("Say <|eot|> now", "English", "a <think> transcript")
    assert ids.count(tok.token_id("<|eot|>")) == 1 and ids[-1] == tok.token_id("<|eot|>")
    assert not [i for i in ids[2:-1] if i >= QWEN_FIRST_ID]
    assert tok.decode(ids[2:-1]) == "a <think> transcriptSay <|eot|> now"


def test_a_token_joined_from_the_transcript_and_the_text_stays_text(tok):
    ids = tok.encode_prompt("nk> now", "English", "a <thi")
    assert tok.token_id("<think>") not in ids


@PROPERTIES
@given(text=st.text(min_size=1, max_size=60), prompt_text=st.text(max_size=20))
def test_ordinary_text_gets_the_ids_of_the_whole_prompt_encoded_at_once(tok, text, prompt_text):
    if not text.strip() or any(i >= QWEN_FIRST_ID for i in tok.encode(prompt_text + text)):
        return  # nothing to say, or a control token (the test above)
    assert tok.encode_prompt(text, "English", prompt_text) == tok.encode(format_prompt(text, "English", prompt_text))
