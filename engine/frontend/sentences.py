"""Front end step 3: sentences and segments.

Long text is cut only at sentence ends (:func:`split_sentences`) and the sentences are grouped into
segments (:func:`group_sentences`; Chinese is measured in characters, others in tokens);
:func:`cap_segments` then cuts a segment that would not fit in ``max_patches`` (the reference has no
such cap: it would cut the audio instead).
"""

from __future__ import annotations

import re
from collections.abc import Callable

MERGE_LENGTH = 20  # a last segment shorter than this joins the one before it

_SENTENCE_ENDS = frozenset(".?!;")
_SENTENCE_ENDS_ZH = frozenset("。？！；、.?!;")
_CLOSING_QUOTES = frozenset('"”')


def _inside_number(text: str, i: int) -> bool:
    """A dot between two digits (``0.85``, ``v1.8.3``) ends no sentence."""
    return 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()


def split_sentences(text: str, chinese: bool = False) -> list[str]:
    """Cut ``text`` after each sentence end, as the reference does; the pieces keep their spaces.

    Ends are ``. ? ! ;`` (plus ``。？！；、`` for Chinese); a dot inside a number is not one, and a
    closing quote right after an end stays with its sentence. Like the reference, an end that
    directly follows another one is dropped (``Wait...`` becomes ``Wait.``).
    """
    ends = _SENTENCE_ENDS_ZH if chinese else _SENTENCE_ENDS
    pieces: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in ends or (c == "." and _inside_number(text, i)):
            continue
        if i > start:
            pieces.append(text[start:i] + c)
        start = i + 1
        if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and pieces:
            pieces[-1] += text[i + 1]
            start = i + 2
    if start < len(text):
        pieces.append(text[start:])
    return pieces or [text]


def group_sentences(
    sentences: list[str], length: Callable[[str], int], max_length: int, min_length: int, merge_length: int
) -> list[str]:
    """Join sentences into segments, the reference's way: a segment is closed only once it is longer
    than ``min_length`` and the next sentence would take it past ``max_length``; a last segment
    shorter than ``merge_length`` joins the one before. A segment can so exceed ``max_length`` by
    up to one sentence (see :func:`cap_segments`)."""
    segments: list[str] = []
    current, current_length = "", 0  # length(current), carried over: each candidate is measured once
    for sentence in sentences:
        joined = length(current + sentence)
        if joined > max_length and current_length > min_length:
            segments.append(current)
            current, joined = "", length(sentence)
        current, current_length = current + sentence, joined
    if current:
        if segments and current_length < merge_length:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


# Where an over-long segment may be cut, best first: after a clause mark, after a space.
_BREAKS = (re.compile(r"(?<=[,，、:：;；])"), re.compile(r"(?<=\s)"))


def _cut(text: str, count: Callable[[str], int], cap: int, level: int = 0) -> list[str]:
    """``text`` in consecutive pieces of at most ``cap`` tokens, cut as high up ``_BREAKS`` as can be."""
    if count(text) <= cap:
        return [text]
    if level == len(_BREAKS):
        return _cut_characters(text, count, cap)
    pieces: list[str] = []
    for unit in (u for u in _BREAKS[level].split(text) if u):
        for part in _cut(unit, count, cap, level + 1):
            if pieces and count(pieces[-1] + part) <= cap:
                pieces[-1] += part
            else:
                pieces.append(part)
    return pieces


def _cut_characters(text: str, count: Callable[[str], int], cap: int) -> list[str]:
    pieces = [""]
    for c in text:
        if pieces[-1] and count(pieces[-1] + c) > cap:
            pieces.append("")
        pieces[-1] += c
    return pieces


def cap_segments(segments: list[str], count: Callable[[str], int], cap: int) -> list[str]:
    """Segments over ``cap`` tokens cut at clause marks, then spaces, then between characters.

    The reference never cuts inside a sentence; a segment it makes too long to speak within
    ``max_patches`` is cut short in the audio instead. Here only such a segment is cut (so that
    every word is spoken); every other segment is the reference's.
    """
    return [piece for segment in segments for piece in _cut(segment, count, cap)]


def segment_cap(max_patches: int, split_tokens: int) -> int:
    """Tokens a segment may have: one token takes under two patches of speech, so a segment of
    ``max_patches // 2`` tokens fits in ``max_patches``; never below ``split_tokens``."""
    return max(split_tokens, max_patches // 2)
