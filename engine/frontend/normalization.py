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

# wetext is C++ that keeps the GIL for the whole call, ~1 ms of CPU per character of a text with numbers
# and dates: a 4,000-character segment stopped every other thread of its process for 2 to 7 s (a Triton
# stub's heartbeat too, which reads as a wedged stub). Longer segments go through it in pieces of at most
# this many characters (where a sentence end, else a comma, allows), the GIL free between them.
WETEXT_CHARS = 400
# after a Latin end only with a space ("3.5", "1,000" stay whole); after a CJK one, with or without
_CUTS = (
    re.compile(r"(?<=[.?!;])\s+(?=\S)|(?<=[。？！；])\s*(?=\S)"),
    re.compile(r"(?<=,)\s+(?=\S)|(?<=[，、])\s*(?=\S)"),
)


def wetext_pieces(text: str, limit: int = WETEXT_CHARS) -> list[str]:
    """``text`` cut after sentence ends (else commas), with the spaces that follow, into pieces of at most
    ``limit`` characters where such a cut exists; ``"".join(pieces) == text``."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = None
        for pattern in _CUTS:  # the last cut within the limit, else the first beyond it
            ends = [m.end() for m in pattern.finditer(text, start + 1)]
            if ends:
                within = [e for e in ends if e - start <= limit]
                cut = within[-1] if within else ends[0]
                if within:
                    break
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    return [*pieces, text[start:]]


def _normalize(normalizer, text: str) -> str:
    out = []
    for piece in wetext_pieces(text, WETEXT_CHARS):
        with _wetext_lock:
            normalized = normalizer.normalize(piece)
        out.append(normalized + (" " if piece[-1:].isspace() else ""))  # wetext strips; the cut's space stays
    return "".join(out)


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
            text = tidy_symbols(_normalize(normalizer, text))
        except Exception as e:  # noqa: BLE001 (the reference speaks the text as it is when wetext fails)
            log.warning("text normalization failed (%s: %s); the segment is spoken as written", type(e).__name__, e)
    return tidy_cjk_spaces(text)


# Normalized once at load: wetext's first text with numbers, dates, times and money took ~0.5 s more than
# the next (the GIL held throughout); the heartbeat is not watched yet while a Triton stub initializes.
_WARM_UP = (("en", "On 2024-01-02 at 3:45pm, 12 apples cost $3.50 (25% off); call 555-1234."),
            ("zh", "2024年1月2日下午3点45分，12个苹果3.5元，打75折。"))  # fmt: skip


def load_wetext() -> None:
    """Load wetext's FSTs for both grammars now (about 1 s) rather than on the first segment."""
    for lang, sample in _WARM_UP:
        _wetext(lang).normalize(sample)
