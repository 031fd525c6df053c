"""Long text as parts the server accepts, spoken in order and joined: the one rule that the gateway's job
API (``gateway/jobs``) and the client's ``--text-file`` both follow.

- **Parts** (:func:`split_text`): the text is cut at paragraphs (a blank line), then, for a paragraph over
  the bound, at sentence ends (``. ! ? ;`` and their CJK forms, followed by a space), then at clause marks
  (``, :`` and dashes), then at spaces; whole pieces are packed into parts of at most ``max_chars``
  characters (paragraphs joined by a blank line, pieces of one paragraph by a space). Nothing but
  whitespace is ever dropped. A run of more than ``max_chars`` characters with no space is refused
  (:class:`Unsplittable`), never cut in a word.
- **Seeds**: every part is a request with the job's seed (or none, the server's default), as the server
  speaks the sentences of one long request with one seed: a re-run alone gives the same audio.
- **Join** (:func:`joined`): the parts' audio in order with :data:`JOIN_SILENCE_SECONDS` of silence between
  two parts (none before the first or after the last: one part is exactly one speech request's audio).

    from client import TTSClient
    from client.longform import speak_long, joined
    parts = speak_long(TTSClient("127.0.0.1:8001"), open("chapter.txt").read(), seed=7)
    audio = joined(p.audio for p in parts)  # (n,) float32 at 24 kHz
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from engine.protocol import SAMPLE_RATE
from serving.contract import MAX_TEXT_CHARS

DEFAULT_PART_CHARS = 1000  # characters in a part: a few paragraphs; progress and parallelism per part
JOIN_SILENCE_SECONDS = 0.25  # silence between two parts' audio
PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")
SENTENCE_END = re.compile(r"(?<=[.!?;…])[\"'”’)\]]*\s+|(?<=[。！？；])\s*")
CLAUSE_END = re.compile(r"(?<=[,:，：、—–])\s+|\s+(?=[—–]\s)")
SPACE = re.compile(r"\s+")


class Unsplittable(ValueError):
    """A piece of the text that no boundary makes short enough for a part."""


@dataclass(frozen=True)
class Part:
    """One part's audio, as :func:`speak_long` makes it."""

    index: int  # 0-based, in the text's order
    total: int  # parts in the text
    text: str  # what was spoken
    audio: np.ndarray  # (n,) float32 at 24 kHz


def split_text(text: str, max_chars: int = DEFAULT_PART_CHARS) -> list[str]:
    """``text`` -> its parts, each 1..``max_chars`` characters, in order (see the module's rule).
    ValueError for a text with nothing to say or a ``max_chars`` outside 1..MAX_TEXT_CHARS;
    :class:`Unsplittable` for a run of over ``max_chars`` characters without a space."""
    if not 1 <= max_chars <= MAX_TEXT_CHARS:
        raise ValueError(f"a part is 1..{MAX_TEXT_CHARS} characters (the server's bound), got {max_chars}")
    paragraphs = [p.strip() for p in PARAGRAPH.split(text) if p.strip()]
    if not paragraphs:
        raise ValueError("the text is empty")
    parts: list[str] = []
    for paragraph in paragraphs:
        pieces = [paragraph] if len(paragraph) <= max_chars else _pieces(paragraph, max_chars, text)
        for i, piece in enumerate(pieces):
            sep = "\n\n" if i == 0 else " "  # a paragraph's first piece may join the part before it
            if parts and len(parts[-1]) + len(sep) + len(piece) <= max_chars:
                parts[-1] += sep + piece
            else:
                parts.append(piece)
    return parts


def _pieces(paragraph: str, max_chars: int, text: str) -> list[str]:
    """A paragraph over the bound -> pieces of at most ``max_chars``, each a sentence, clause or words,
    packed greedily with a space between."""
    out: list[str] = []
    for sentence in _cut(paragraph, SENTENCE_END):
        for clause in [sentence] if len(sentence) <= max_chars else _cut(sentence, CLAUSE_END):
            for words in [clause] if len(clause) <= max_chars else _cut(clause, SPACE):
                if len(words) > max_chars:
                    at = text.find(words)
                    raise Unsplittable(
                        f"the text has {len(words)} characters without a space at character {at} "
                        f"({words[:20]!r}...); a part is at most {max_chars} characters: add spaces or sentence ends"
                    )
                if out and len(out[-1]) + 1 + len(words) <= max_chars:
                    out[-1] += " " + words
                else:
                    out.append(words)
    return out


def _cut(text: str, boundary: re.Pattern) -> list[str]:
    return [piece.strip() for piece in boundary.split(text) if piece.strip()]


def joined(parts: Iterable[np.ndarray]) -> np.ndarray:
    """Parts' audio ((n,) float32 at 24 kHz each) in order, :data:`JOIN_SILENCE_SECONDS` between two."""
    out: list[np.ndarray] = []
    for audio in parts:
        if out:
            out.append(silence())
        out.append(np.asarray(audio, np.float32).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def silence() -> np.ndarray:
    """The gap between two parts: (JOIN_SILENCE_SECONDS x 24 kHz,) zeros."""
    return np.zeros(round(JOIN_SILENCE_SECONDS * SAMPLE_RATE), np.float32)


def speak_long(client, text: str, max_chars: int = DEFAULT_PART_CHARS, on_part: Callable[[Part], None] | None = None,
               **settings) -> Iterator[Part]:  # fmt: skip
    """``text`` split by :func:`split_text`, each part spoken by ``client`` (a :class:`client.TTSClient`,
    gRPC or HTTP) with the same ``settings`` (voice, seed, parameters: :meth:`TTSClient.synthesize`'s), one
    after the other -> the parts as each is done. The split is checked before anything is sent."""
    parts = split_text(text, max_chars)
    for i, part_text in enumerate(parts):
        part = Part(i, len(parts), part_text, client.synthesize(part_text, **settings))
        if on_part is not None:
            on_part(part)
        yield part
