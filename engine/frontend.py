"""Text front end: what the model is asked to say, decided before the first patch.

FireRedTTS3 was trained on text that went through a front end, and its reference pipeline runs that
front end on every input. Feeding raw text instead changes the token ids, and so the audio, for most
ordinary inputs (numbers, times, currency, quotes, markdown, emoji, long text). This module does
what the reference does, in its order:

1. :func:`clean` — drops zero-width, private-use and control characters, markdown syntax and emoji,
   and collapses whitespace;
2. :func:`detect_language` — when no language is given (or ``auto``);
3. :func:`split_sentences` and :func:`group_sentences` — long text is cut only at sentence ends and
   the sentences are grouped into segments (Chinese is measured in characters, others in tokens);
   :func:`cap_segments` then cuts a segment that would not fit in ``max_patches`` (the reference
   has no such cap: it would cut the audio instead);
4. :func:`normalize_segment` — ``wetext`` text normalization (numbers, dates, currency, ...) for
   Chinese, English, Cantonese and the ``ZH_*`` dialects, then the symbol clean-up that follows it.

:func:`prepare` runs all of it; the offline path and the ``tts`` model both call it (through
:class:`engine.orchestrator.Orchestrator`). ``python -m engine.text "..."`` shows its result.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import regex

from engine.text import canonical_language

log = logging.getLogger(__name__)
LID_MODEL_ENV = "FIREREDTTS3_LID_MODEL"  # optional fastText language-id model (lid.176.bin / .ftz)
MERGE_LENGTH = 20  # a last segment shorter than this joins the one before it
EMPTY_MESSAGE = "TEXT: nothing to speak after cleaning"

# ---------------------------------------------------------------------------------------------
# 1. Cleaning
# ---------------------------------------------------------------------------------------------

# Format characters (zero-width space, BOM, bidi marks, soft hyphen...) except the zero-width
# joiner, which the reference keeps; and private-use characters.
_INVISIBLE = regex.compile(r"[\p{Cf}--[\u200d]]|\p{Co}", flags=regex.V1)
# Control characters other than whitespace: the reference passes them on; they cannot be spoken.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_EMOJI = regex.compile(r"\p{Emoji_Presentation}|\p{Emoji}\uFE0F")

# Markdown rules in the order they apply; line-anchored ones see each line (re.MULTILINE).
# Emphasis is only unwrapped at the start of a line, where * and ~ cannot be arithmetic.
_MARKDOWN: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(pattern, re.MULTILINE), repl)
    for pattern, repl in (
        (r"!\[[^\]]*\]\([^\)]+\)", ""),  # image: dropped
        (r"\[([^\]]+)\]\([^)]+\)", r"\1"),  # link: its text
        (r"^(\s*)-\s+", r"\1"),  # list dash
        (r"^#{1,6}\s*", ""),  # heading marks
        (r"^\s*\*\*([^*]+)\*\*", r"\1"),  # **bold** opening a line
        (r"^\s*__([^_]+)__", r"\1"),
        (r"^\s*\*([^*]+)\*", r"\1"),
        (r"^\s*~~([^~]+)~~", r"\1"),
        (r"^\s*[*~]\s+", ""),  # list star
        (r"\n\s*\n", "\n"),  # blank lines
    )
)


def _strip_invisible(text: str) -> str:
    """Characters that carry no sound go; odd spaces and line separators become plain ones."""
    text = text.encode("utf-8", "ignore").decode("utf-8")  # lone surrogates cannot be encoded
    text = _CONTROL.sub("", _INVISIBLE.sub("", text))
    text = text.replace("\u00a0", " ").replace("\ufffd", "")
    return text.replace("\u2028", "\n").replace("\u2029", "\n")


def _strip_markdown(text: str) -> str:
    for pattern, repl in _MARKDOWN:
        text = pattern.sub(repl, text)
    return text.strip()


def clean(text: str) -> str:
    """Text as the reference cleans it before anything else: invisible and control characters,
    markdown syntax and emoji removed, every run of whitespace one space, ends trimmed.

    >>> clean("**Note:** see [docs](http://x.io)  😀\\n\\nok")
    'Note: see docs ok'
    """
    if not text:
        return ""
    text = _EMOJI.sub("", _strip_markdown(_strip_invisible(text)))
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------------------------
# 2. Language detection
# ---------------------------------------------------------------------------------------------

_HAN = re.compile(r"[\u4e00-\u9fff]")
_KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff]")
# fastText's ISO 639-1 labels for the languages the model has a tag for.
_ISO_TO_LANGUAGE = {
    "zh": "Chinese", "en": "English", "ja": "Japanese", "ko": "Korean", "es": "Spanish",
    "fr": "French", "ru": "Russian", "ar": "Arabic", "tr": "Turkish", "id": "Indonesian",
    "pt": "Portuguese", "it": "Italian", "nl": "Dutch", "vi": "Vietnamese", "de": "German",
    "uk": "Ukrainian", "th": "Thai", "pl": "Polish", "ro": "Romanian", "el": "Greek",
    "cs": "Czech", "fi": "Finnish", "hi": "Hindi",
}  # fmt: skip
# Scripts the fastText model is asked about (Latin needs a word of 3+ letters to be worth asking).
_OTHER_SCRIPTS = re.compile(r"[\uac00-\ud7af\u0400-\u052f\u0600-\u06ff\u0750-\u077f\u0900-\u097f\u0e00-\u0e7f\u0370-\u03ff]")
_CJK_PUNCTUATION = re.compile(r"[\u3000-\u303f\uff01-\uff0f\uff1a-\uff20]")


def detect_by_script(text: str) -> str:
    """The reference's rule when it has no language-id model: any Han character means Chinese, else
    any kana means Japanese, else English (so Korean or Russian text without a language is English)."""
    if _HAN.search(text):
        return "Chinese"
    if _KANA.search(text):
        return "Japanese"
    return "English"


class FastTextLid:
    """A fastText language-id model (Meta's ``lid.176``), used as the reference uses it when present:
    kana, Han and CJK punctuation decide on their own; other text is asked to the model, and a
    label without a FireRedTTS3 language falls back to :func:`detect_by_script`.

    The model file is never downloaded: pass its path (or set ``FIREREDTTS3_LID_MODEL``).

    Raises:
        RuntimeError: the ``fasttext`` package is not installed.
        FileNotFoundError: no file at ``path``.
    """

    def __init__(self, path: str | Path):
        try:
            import fasttext  # optional dependency
        except ImportError:
            raise RuntimeError(
                f"language-id model {path} given, but the fasttext package is not installed "
                "(pip install fasttext-wheel), or unset it to detect by script"
            ) from None
        if not Path(path).is_file():
            raise FileNotFoundError(f"language-id model not found: {path}")
        self._model = fasttext.load_model(str(path))
        self._lock = threading.Lock()

    def guess(self, text: str) -> str | None:
        """The model's top language, if FireRedTTS3 has a tag for it."""
        snippet = text.replace("\n", " ").strip()
        if not snippet:
            return None
        with self._lock:
            preds = self._model.f.predict(snippet, 1, 0.0, "strict")  # numpy-2-safe low-level call
        if not preds:
            return None
        return _ISO_TO_LANGUAGE.get(preds[0][1].removeprefix("__label__"))

    def __call__(self, text: str) -> str:
        if _KANA.search(text):
            return "Japanese"
        if _HAN.search(text) or _CJK_PUNCTUATION.search(text):
            return "Chinese"
        worth_asking = _OTHER_SCRIPTS.search(text) or regex.search(r"[A-Za-zÀ-ÿ]{3,}", text)
        return (worth_asking and self.guess(text)) or detect_by_script(text)


_lid: Callable[[str], str] | None = None
_lid_loaded = False


def use_lid_model(path: str | Path | None) -> None:
    """Detect languages with the fastText model at ``path`` from now on (None: by script)."""
    global _lid, _lid_loaded
    _lid, _lid_loaded = (FastTextLid(path) if path else None), True


def detect_language(text: str) -> str:
    """The language of ``text``: by the fastText model if one is configured (:func:`use_lid_model`,
    or ``FIREREDTTS3_LID_MODEL`` read on first use), else by :func:`detect_by_script`."""
    if not _lid_loaded:
        use_lid_model(os.environ.get(LID_MODEL_ENV) or None)
    return (_lid or detect_by_script)(text)


# ---------------------------------------------------------------------------------------------
# 3. Sentences and segments
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# 4. Normalization
# ---------------------------------------------------------------------------------------------

_WETEXT_LANGUAGES = frozenset({"Chinese", "English", "Cantonese"})  # and every ZH_* dialect

# After wetext: odd symbols reduced, then separators read as a pause (comma) or as a space.
_SYMBOL_VARIANTS = str.maketrans({
    "〜": "~", "～": "~", "・": "·", "•": "·", "‧": "·",
    "…": "...", "⋯": "...", "〰": "...", "﹏": "...",
})  # fmt: skip
_AS_SPACE = re.compile(r"[·•‧│|¦/\\]")
_AS_COMMA = re.compile(r"[…~&*%$#^:;/\\|]+")
_UNSPEAKABLE = re.compile(
    r"[^\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff0-9A-Za-z，。、？！：；…—～·.,:;!?()\[\]'\"\-_\s]"
)
_CJK = "\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff"
_CJK_SPACES = tuple(
    re.compile(p) for p in (rf"([{_CJK}])\s+([{_CJK}])", rf"([{_CJK}])\s+([a-zA-Z0-9])", rf"([a-zA-Z0-9])\s+([{_CJK}])")
)


def normalized_by_wetext(language: str) -> bool:
    """Whether the reference normalizes text of ``language`` (wetext has Chinese and English only)."""
    return language in _WETEXT_LANGUAGES or language.startswith("ZH_")


@functools.cache
def _wetext(lang: str):
    """One wetext normalizer per language ("zh" drops erhua, as the reference's); its FSTs ship in
    the wheel, so nothing is downloaded."""
    try:
        from wetext import Normalizer  # loads its FSTs on first use
    except ImportError:
        raise RuntimeError(
            "text normalization needs the wetext package (pip install wetext), or turn it off "
            "(request parameter normalize=false, --no-normalize)"
        ) from None
    return Normalizer(lang="zh", operator="tn", remove_erhua=True) if lang == "zh" else Normalizer(lang="en", operator="tn")


_wetext_lock = threading.Lock()


def tidy_symbols(text: str) -> str:
    """What follows wetext in the reference: separators read as commas or spaces, symbols outside
    CJK, ASCII letters, digits and common punctuation dropped, commas and spaces tidied."""
    text = text.translate(_SYMBOL_VARIANTS)
    text = _AS_COMMA.sub(",", _AS_SPACE.sub(" ", text))
    text = re.sub(r"[ \t]+", " ", _UNSPEAKABLE.sub("", text)).strip()
    text = re.sub(r"[,，]{2,}", ",", text)
    text = re.sub(r"\s+[,，]", ",", text)
    return re.sub(r"[,，]+\s*$", "", text)


def tidy_cjk_spaces(text: str) -> str:
    """Spaces between two CJK characters, or between CJK and a Latin letter or digit, removed
    (one pass per pattern, left to right, as the reference does)."""
    for pattern in _CJK_SPACES:
        text = pattern.sub(r"\1\2", text)
    return text


def normalize_segment(text: str, language: str) -> str:
    """One segment as the reference normalizes it: wetext for Chinese, English, Cantonese and the
    dialects (its Chinese grammar when the segment has a Han character, else its English one),
    nothing for other languages; then :func:`tidy_cjk_spaces` for all."""
    if normalized_by_wetext(language):
        normalizer = _wetext("zh" if _HAN.search(text) else "en")
        try:
            with _wetext_lock:
                text = normalizer.normalize(text)
            text = tidy_symbols(text)
        except Exception as e:  # noqa: BLE001 (the reference speaks the text as it is when wetext fails)
            log.warning("text normalization failed (%s: %s); the segment is spoken as written", type(e).__name__, e)
    return tidy_cjk_spaces(text)


def warm_up() -> None:
    """Load what the first request would otherwise wait for: wetext's FSTs (about 0.3 s) and the
    language-id model, if one is configured (so that a bad path fails at startup)."""
    for lang, sample in (("en", "1"), ("zh", "一")):
        _wetext(lang).normalize(sample)
    detect_language("warm up")


# ---------------------------------------------------------------------------------------------
# All of it
# ---------------------------------------------------------------------------------------------


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
        ValueError: nothing is left to speak, or the language is unknown.
    """
    language = None if language is None or language.strip().lower() in ("", "auto") else canonical_language(language)
    text = clean(text)
    if not text:
        raise ValueError(EMPTY_MESSAGE)
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
        raise ValueError(EMPTY_MESSAGE)
    return Prepared(language, segments)


def describe(prepared: Prepared, count: Callable[[str], int]) -> str:
    """A readable account of :func:`prepare`'s result, one segment a line with its token count."""
    lines = [f"language: {prepared.language}"]
    lines += [f"[{i}] ({count(s)} tokens) {s!r}" for i, s in enumerate(prepared.segments)]
    return "\n".join(lines)

