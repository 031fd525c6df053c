"""Front end step 4: ``wetext`` text normalization (numbers, dates, currency, ...) for Chinese,
English, Cantonese and the ``ZH_*`` dialects, then the symbol clean-up that follows it.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

from engine.frontend.language import HAN

log = logging.getLogger(__name__)

_WETEXT_LANGUAGES = frozenset({"Chinese", "English", "Cantonese"})  # and every ZH_* dialect

# After wetext: odd symbols reduced, then separators read as a pause (comma) or as a space.
_SYMBOL_VARIANTS = str.maketrans({
    "〜": "~", "～": "~", "・": "·", "•": "·", "‧": "·",
    "…": "...", "⋯": "...", "〰": "...", "﹏": "...",
})  # fmt: skip
_AS_SPACE = re.compile(r"[·•‧│|¦/\\]")
_AS_COMMA = re.compile(r"[…~&*%$#^:;/\\|]+")
_UNSPEAKABLE = re.compile(r"[^\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff0-9A-Za-z，。、？！：；…—～·.,:;!?()\[\]'\"\-_\s]")
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
    return (
        Normalizer(lang="zh", operator="tn", remove_erhua=True)
        if lang == "zh"
        else Normalizer(lang="en", operator="tn")
    )


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
        normalizer = _wetext("zh" if HAN.search(text) else "en")
        try:
            with _wetext_lock:
                text = normalizer.normalize(text)
            text = tidy_symbols(text)
        except Exception as e:  # noqa: BLE001 (the reference speaks the text as it is when wetext fails)
            log.warning("text normalization failed (%s: %s); the segment is spoken as written", type(e).__name__, e)
    return tidy_cjk_spaces(text)


def load_wetext() -> None:
    """Load wetext's FSTs for both grammars now (about 0.3 s) rather than on the first segment."""
    for lang, sample in (("en", "1"), ("zh", "一")):
        _wetext(lang).normalize(sample)
