"""Long text: split it into segments that are synthesized one after another and joined with a short
linear cross-fade, as the reference does (sentences merged up to ~80 tokens, 50 ms fade, same seed).

Both the offline path and the ``tts`` model use these functions, so a long text streams exactly as it
synthesizes offline. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Sequence

import numpy as np

FADE_SAMPLES = 1200  # 50 ms at 24 kHz
SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s+|(?<=[。！？；…])")
CLAUSE_END = re.compile(r"(?<=[,:，、：])\s*")


def _join(a: str, b: str) -> str:
    """Concatenate two pieces: with a space, except next to CJK text (which has none)."""
    cjk = re.compile(r"[\u3000-\u9fff\uff00-\uffef]")
    return a + b if cjk.match(a[-1:]) or cjk.match(b[:1]) else f"{a} {b}"


def _pieces(text: str, pattern: re.Pattern) -> list[str]:
    return [p for p in pattern.split(text) if p and p.strip()]


def split_text(text: str, count: Callable[[str], int], max_tokens: int = 80, merge_tokens: int = 20) -> list[str]:
    """Split ``text`` into segments of at most ``max_tokens`` tokens (by ``count``) where possible.

    Sentences are kept whole and merged greedily; a sentence longer than the limit is cut at clauses,
    then at spaces; a last segment shorter than ``merge_tokens`` joins the one before it. ``max_tokens``
    <= 0 disables splitting. The segments joined (with spaces, none between CJK text) read as the text.
    """
    text = text.strip()
    if max_tokens <= 0 or count(text) <= max_tokens:
        return [text]
    units: list[str] = []
    for sentence in _pieces(text, SENTENCE_END):
        if count(sentence) <= max_tokens:
            units.append(sentence.strip())
            continue
        for clause in _pieces(sentence, CLAUSE_END):
            if count(clause) <= max_tokens:
                units.append(clause.strip())
            else:
                units.extend(_by_words(clause, count, max_tokens))
    segments: list[str] = []
    for u in units:
        joined = _join(segments[-1], u) if segments else u
        if segments and count(joined) <= max_tokens:
            segments[-1] = joined
        else:
            segments.append(u)
    if len(segments) > 1 and count(segments[-1]) < merge_tokens:
        last = segments.pop()
        segments[-1] = _join(segments[-1], last)
    return segments


def _by_words(text: str, count: Callable[[str], int], max_tokens: int) -> list[str]:
    out: list[str] = []
    for word in text.split():
        if out and count(_join(out[-1], word)) <= max_tokens:
            out[-1] = _join(out[-1], word)
        else:
            out.append(word)  # a single word longer than the limit stays whole
    return out


def chunk_sizes(schedule: Sequence[int]) -> Iterator[int]:
    """3, 12, 12, ... for (3, 12): the first entries once, the last one forever (validated now)."""
    if not schedule or any(n < 1 for n in schedule):
        raise ValueError(f"chunk schedule must be positive patch counts, got {list(schedule)}")
    return itertools.chain(schedule, itertools.repeat(schedule[-1]))


def segment_schedule(index: int, schedule: tuple[int, ...]) -> tuple[int, ...]:
    """Chunk schedule of segment ``index``: the first segment starts small for latency; later ones
    follow audio that is already playing, so they use the steady chunk size throughout."""
    return tuple(schedule) if index == 0 else (schedule[-1],)


class Joiner:
    """Joins segment audio streams with a linear cross-fade, holding back only what the fade needs.

    ``push(audio, more_segments)`` returns the samples that can be emitted now; while later segments
    follow, the last ``fade`` samples of the current one are held. ``start_segment()`` marks that the
    next pushed samples begin a new segment.
    """

    def __init__(self, fade: int = FADE_SAMPLES):
        self.fade = fade
        self.held = np.zeros(0, np.float32)  # tail of the previous segment, not yet emitted
        self.head = np.zeros(0, np.float32)  # start of the new segment, waiting for `fade` samples
        self.joining = False

    def start_segment(self) -> None:
        self.joining = self.held.size > 0

    def _mix(self, n: int) -> np.ndarray:
        ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
        mixed = self.held[self.held.size - n :] * (1.0 - ramp) + self.head[:n] * ramp
        out = np.concatenate([self.held[: self.held.size - n], mixed, self.head[n:]])
        self.held, self.head, self.joining = np.zeros(0, np.float32), np.zeros(0, np.float32), False
        return out

    def push(self, audio: np.ndarray, more_segments: bool) -> np.ndarray:
        audio = np.asarray(audio, np.float32)
        if self.joining:
            self.head = np.concatenate([self.head, audio])
            if self.head.size < min(self.fade, self.held.size):
                return np.zeros(0, np.float32)
            audio = self._mix(min(self.fade, self.held.size))
        if not more_segments:
            return audio
        keep = np.concatenate([self.held, audio])
        cut = max(0, keep.size - self.fade)
        self.held = keep[cut:]
        return keep[:cut]

    def finish(self) -> np.ndarray:
        """What is still held: a fade cut short by a segment shorter than the fade."""
        if self.joining and self.head.size:
            return self._mix(min(self.held.size, self.head.size))
        out = np.concatenate([self.held, self.head])
        self.held = self.head = np.zeros(0, np.float32)
        self.joining = False
        return out
