"""A context's audio as the agent socket sends it: raw samples in Cartesia's encodings at the asked rate, and
approximate word timings.

Timings: the model has no aligner, so each flushed unit's words are spread over that unit's audio in
proportion to their characters (a word and the space after it), from the first sample after the previous
unit to the last sample of this one. They are sent when the unit's audio is complete (Pipecat takes the
words into the conversation from them; LiveKit's timed transcript is aligned by them).
"""

from __future__ import annotations

import numpy as np

from engine.protocol import SAMPLE_RATE
from gateway.encode import G711, pcm16
from gateway.rates import StreamResampler


class RawOutput:
    """float32 24 kHz chunks -> bytes of ``encoding`` (``pcm_s16le``, ``pcm_f32le``, ``pcm_mulaw``,
    ``pcm_alaw``) at ``sample_rate`` Hz; ``volume`` scales the samples first (then clipped to [-1, 1])."""

    def __init__(self, encoding: str, sample_rate: int, volume: float | None = None):
        self.encoding, self.volume = encoding, volume
        self.resampler = StreamResampler(sample_rate)

    def push(self, audio: np.ndarray) -> bytes:
        audio = np.asarray(audio, np.float32).reshape(-1)
        if self.volume is not None:
            audio = audio * np.float32(self.volume)
        return self._bytes(self.resampler.push(audio))

    def finish(self) -> bytes:
        return self._bytes(self.resampler.finish())

    def _bytes(self, audio: np.ndarray) -> bytes:
        if self.encoding == "pcm_f32le":
            return np.clip(audio, -1.0, 1.0).astype("<f4").tobytes()
        samples = pcm16(audio)
        if self.encoding in G711:
            return G711[self.encoding](np.frombuffer(samples, "<i2")).tobytes()
        return samples


def word_times(text: str, start: float, end: float) -> tuple[list[str], list[float], list[float]]:
    """The words of ``text`` spread over [``start``, ``end``] seconds by their length -> (words, starts, ends)."""
    words = text.split()
    if not words:
        return [], [], []
    weights = np.array([len(w) + 1 for w in words], np.float64)
    edges = start + (end - start) * np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum()
    starts = [round(float(t), 3) for t in edges[:-1]]
    ends = [round(float(t), 3) for t in edges[1:]]
    return words, starts, ends


def char_times(text: str, start: float, end: float) -> tuple[list[str], list[float], list[float]]:
    """Every character of ``text`` with times in [``start``, ``end``] seconds, from :func:`word_times`: a word's
    share is split evenly over its characters and the whitespace after it (which shares the last step, or, at
    the text's end without one, goes to the last character);
    whitespace before the first word is at ``start``, zero long -> (characters, starts, ends), non-decreasing."""
    words, starts, ends = word_times(text, start, end)
    if not words:
        return list(text), [start] * len(text), [start] * len(text)
    chars, char_starts, char_ends = [], [], []
    at = 0
    for i, (word, s, e) in enumerate(zip(words, starts, ends, strict=True)):
        found = text.index(word, at)
        if i == 0:  # leading whitespace
            chars += text[at:found]
            char_starts += [start] * (found - at)
            char_ends += [start] * (found - at)
        after = found + len(word)
        following = after + len(text[after:]) - len(text[after:].lstrip())  # the whitespace run after it
        step = (e - s) / (len(word) + 1)
        for k, ch in enumerate(text[found:following]):
            chars.append(ch)
            char_starts.append(round(s + min(k, len(word)) * step, 3))
            last = k >= len(word) - 1 and following == after or k >= len(word)  # the word's last step is its own
            char_ends.append(e if last else round(s + (k + 1) * step, 3))
        at = following
    return chars, char_starts, char_ends


def seconds(samples: int) -> float:
    """Samples at the model's rate -> seconds."""
    return samples / SAMPLE_RATE
