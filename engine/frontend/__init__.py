"""Text front end: what the model is asked to say, decided before the first patch.

FireRedTTS3 was trained on text that went through a front end, and its reference pipeline runs that
front end on every input. Feeding raw text instead changes the token ids, and so the audio, for most
ordinary inputs (numbers, times, currency, quotes, markdown, emoji, long text). This package does
what the reference does, in its order, one module per step:

1. :mod:`engine.frontend.cleaning` — :func:`~engine.frontend.cleaning.clean` drops zero-width,
   private-use and control characters, markdown syntax and emoji, and collapses whitespace;
2. :mod:`engine.frontend.language` — :func:`~engine.frontend.language.detect_language` when no
   language is given (or ``auto``);
3. :mod:`engine.frontend.sentences` — long text is cut only at sentence ends and the sentences are
   grouped into segments (Chinese is measured in characters, others in tokens), and a segment that
   would not fit in ``max_patches`` is cut (the reference has no such cap: it would cut the audio);
4. :mod:`engine.frontend.normalization` — ``wetext`` text normalization (numbers, dates, currency,
   ...) for Chinese, English, Cantonese and the ``ZH_*`` dialects, then the symbol clean-up that
   follows it;
5. the segments, which are what the tokenizer reads, are checked for the tokenizer's control tokens
   (:func:`engine.instructions.control_token_error`): cleaning removes zero-width and format characters,
   so ``<\u200b|eot|>`` sent becomes ``<|eot|>`` here, however the text arrived (whole, or in pieces).

:func:`prepare` runs all of it; the offline path and the ``tts`` model both call it (through
:class:`engine.orchestrator.Orchestrator`). ``python -m engine.frontend "..."`` shows its result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.frontend.cleaning import clean
from engine.frontend.language import detect_language
from engine.frontend.normalization import load_wetext, normalize_segment
from engine.frontend.sentences import MERGE_LENGTH, cap_segments, group_sentences, segment_cap, split_sentences
from engine.instructions import control_token_error
from engine.text import canonical_language

EMPTY_MESSAGE = "TEXT: nothing to speak after cleaning"


class NothingToSpeak(ValueError):
    """The text is empty once cleaned and normalized (a ValueError, with :data:`EMPTY_MESSAGE`)."""


def warm_up() -> None:
    """Load what the first request would otherwise wait for: wetext's FSTs (about 0.3 s) and the
    language-id model, if one is configured (so that a bad path fails at startup)."""
    load_wetext()
    detect_language("warm up")


@dataclass(frozen=True)
class Prepared:
    """What the model will say: the language and the text segments, each spoken on its own."""

    language: str
    segments: list[str]


def prepare(
    text: str,
    language: str | None,
    count: Callable[[str], int],
    split_tokens: int = 80,
    normalize: bool = True,
    max_patches: int = 400,
) -> Prepared:
    """The front end: clean, detect the language (``language`` None or ``auto``), split, normalize.

    Args:
        text: what the client sent.
        language: a language or dialect name (any case), or None / ``auto`` to detect it.
        count: tokens of a text (the model's tokenizer, no special tokens).
        split_tokens: segment length: sentences are grouped while a segment stays within it (in
            characters for Chinese, as the reference measures it); 0 keeps the text in one segment.
        normalize: False skips wetext and the symbol clean-up (cleaning and splitting still run).
        max_patches: the per-segment length limit; segments longer than :func:`segment_cap`
            tokens are cut so that each fits.

    Raises:
        ValueError: nothing is left to speak (:class:`NothingToSpeak`), the language is unknown, or a
            segment carries a control token of the tokenizer (naming TEXT and the token).
    """
    language = None if language is None or language.strip().lower() in ("", "auto") else canonical_language(language)
    text = clean(text)
    if not text:
        raise NothingToSpeak(EMPTY_MESSAGE)
    language = language or detect_language(text)
    if split_tokens > 0:
        chinese = language == "Chinese"
        length = len if chinese else count
        sentences = split_sentences(text, chinese)
        segments = group_sentences(sentences, length, split_tokens, split_tokens * 3 // 4, MERGE_LENGTH)
        segments = cap_segments(segments, count, segment_cap(max_patches, split_tokens))
    else:
        segments = [text]
    if normalize:
        segments = [normalize_segment(s, language) for s in segments]
    segments = [s for s in segments if s.strip()]
    if not segments:
        raise NothingToSpeak(EMPTY_MESSAGE)
    for segment in segments:
        problem = control_token_error(segment)
        if problem:
            raise ValueError(f"TEXT {problem}; the text is checked as the model reads it (cleaned of zero-width "
                             "and format characters, and normalized if asked)")  # fmt: skip
    return Prepared(language, segments)


def describe(prepared: Prepared, count: Callable[[str], int]) -> str:
    """A readable account of :func:`prepare`'s result, one segment a line with its token count."""
    lines = [f"language: {prepared.language}"]
    lines += [f"[{i}] ({count(s)} tokens) {s!r}" for i, s in enumerate(prepared.segments)]
    return "\n".join(lines)
