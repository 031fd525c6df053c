"""Text in as an LLM writes it: pieces of text arrive (``push``), with ``flush`` and ``end``, and come out
as the segments the model speaks, cut by the same front end as a whole text (:func:`engine.frontend.prepare`).

The text between two releases is a *unit*, and a unit goes through ``prepare`` whole: cleaning, sentences
grouped up to ``split_tokens``, the ``max_patches`` cap, normalization. So a whole text pushed at once and
then ended gives ``prepare``'s segments, and a segment never spans a release: a flush is a hard boundary
(the agent plugins flush at the end of each sentence, or send one sentence a message, and want it spoken
now, not grouped with the next).

A unit is released by ``flush`` or ``end``, and, with ``release="sentence"``, also by the end of each
sentence as it is confirmed in the raw text (for clients that stream tokens and never flush):
``. ? ! ;`` followed by whitespace (not a dot inside a number such as 3.5, which the next character
settles; a run such as ``...`` or ``?!`` ends once, after its last mark; closing quotes stay with the
sentence), or a full-width ``。？！；`` followed by anything but another mark (Chinese has no spaces).
These are :func:`engine.frontend.sentences.split_sentences`'s ends, found before the text is cleaned.

The language, when not given (None or ``auto``), is detected on the first unit that has something to say
and kept for the rest of the stream (``prepare`` would detect it anew for each call).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.frontend import NothingToSpeak, prepare

MAX_PENDING_CHARS = 4000  # text held without a release (the speech endpoint's input limit)
RELEASES = ("flush", "sentence")
_ENDS = frozenset(".?!;")
_WIDE_ENDS = frozenset("。？！；")
_CLOSING_QUOTES = frozenset('"”')


def last_sentence_end(text: str) -> int:
    """The position just after the last confirmed sentence end in ``text`` (raw, as it arrived), or 0."""
    for i in range(len(text) - 1, -1, -1):
        if text[i] not in _ENDS and text[i] not in _WIDE_ENDS:
            continue
        j = i + 1
        while j < len(text) and text[j] in _CLOSING_QUOTES:
            j += 1
        if j == len(text) or text[j] in _ENDS or text[j] in _WIDE_ENDS:
            continue  # unsettled (the next character decides: 3.5, ?!, a quote), or not a run's last mark
        if text[i] in _ENDS and not text[j].isspace():
            continue  # 3.5, v1.8, e.g.: an ASCII mark ends a sentence before whitespace only
        return j
    return 0


class TextInSegmenter:
    """One stream of text in -> segments out. ``push(piece)``, ``flush()`` and ``end()`` each return the
    segments released by that call (possibly none), in speaking order; after ``end`` nothing more is taken.

    Args:
        language: a language or dialect name, or None / ``auto`` to detect it once (see the module).
        count: tokens of a text (the model's tokenizer), as ``prepare`` takes it.
        split_tokens, normalize, max_patches: as ``prepare`` takes them, for every unit.
        release: ``"flush"`` (units end at flush and end) or ``"sentence"`` (also at each sentence end).
    """

    def __init__(
        self,
        language: str | None,
        count: Callable[[str], int],
        split_tokens: int = 80,
        normalize: bool = True,
        max_patches: int = 400,
        release: str = "flush",
    ):
        if release not in RELEASES:
            raise ValueError(f"release must be one of {list(RELEASES)}, got {release!r}")
        self.language = language
        self.count, self.split_tokens, self.normalize, self.max_patches = count, split_tokens, normalize, max_patches
        self.release = release
        self.pending = ""  # raw text of the unit not released yet
        self.ended = False

    def push(self, text: str) -> list[str]:
        if self.ended:
            raise ValueError("the text stream has ended")
        if len(self.pending) + len(text) > MAX_PENDING_CHARS:
            raise ValueError(f"over {MAX_PENDING_CHARS} characters of text without a flush")
        self.pending += text
        if self.release != "sentence":
            return []
        cut = last_sentence_end(self.pending)
        if cut == 0:
            return []
        unit, self.pending = self.pending[:cut], self.pending[cut:]
        return self._segments(unit)

    def flush(self) -> list[str]:
        if self.ended:
            raise ValueError("the text stream has ended")
        unit, self.pending = self.pending, ""
        return self._segments(unit)

    def end(self) -> list[str]:
        segments = self.flush()
        self.ended = True
        return segments

    def _segments(self, unit: str) -> list[str]:
        try:
            prepared = prepare(unit, self.language, self.count, self.split_tokens, self.normalize, self.max_patches)
        except NothingToSpeak:  # whitespace, markup or emoji only (a lone " " ends LiveKit's contexts)
            return []
        self.language = prepared.language  # detected once, then kept
        return prepared.segments
