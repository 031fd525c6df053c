"""Front end step 1: the text as the reference cleans it before anything else.

Drops zero-width, private-use and control characters, markdown syntax and emoji, and collapses
whitespace (:func:`clean`).
"""

from __future__ import annotations

import re

import regex

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
