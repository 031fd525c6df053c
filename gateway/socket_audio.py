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


def seconds(samples: int) -> float:
    """Samples at the model's rate -> seconds."""
    return samples / SAMPLE_RATE
