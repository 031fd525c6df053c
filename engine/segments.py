"""Long text: its segments (made by :func:`engine.frontend.prepare`) are synthesized each with the same
seed, and joined in order with a 50 ms linear cross-fade, as the reference does.

Read-ahead (the ``read_ahead`` request parameter): up to K segments of one utterance may generate at once
on free generator slots (:class:`engine.orchestrator.Orchestrator`); their audio waits in order and goes
through the same cross-fade. Each segment's stream draws its noise from a generator of its own seeded with
the utterance's seed (``GenerationParams.seed``, the same for every segment: the reference reseeds per
sentence), so what a segment samples depends on nothing but its text, prompt and seed, never on when it
starts or what ran before it: a segment run ahead, or cancelled and run again from scratch, makes the same
latents. Who gets a free slot first is :func:`ahead_may_start` and :func:`ahead_to_yield` below.

Both the offline path and the ``tts`` model use these functions, so a long text streams exactly as it
synthesizes offline. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.chunking import ChunkSchedule

FADE_SAMPLES = 1200  # 50 ms at 24 kHz


def segment_schedule(index: int, schedule: ChunkSchedule, buffered: float = 0.0) -> ChunkSchedule:
    """Chunk schedule of segment ``index``, whose stream starts while the listener holds ``buffered``
    seconds of the earlier segments' audio: its chunks follow the deadline rule from there (with no
    audio left, it starts as the first segment did). A fixed schedule's later segments use the steady
    chunk size throughout, as before the rule."""
    if index == 0:
        return schedule
    if schedule.fixed:
        return ChunkSchedule(schedule.cap, schedule.cap, fixed=True)
    return replace(schedule, buffered=max(0.0, buffered))


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


# ---- read-ahead: who gets a generator slot (plain ints; the orchestrator and the slot keepers apply it) ----


def ahead_may_start(free: int, waiting: int) -> bool:
    """May a read-ahead segment take a generator slot now? Only when one is ``free`` and no start
    (anyone's first segment, or a segment being played) is ``waiting`` for one: a read-ahead segment
    never takes the slot a waiting start needs."""
    return free > 0 and waiting == 0


def ahead_to_yield(waiting: int, yielding: int, ahead: int) -> int:
    """How many of the ``ahead`` running read-ahead segments to cancel now, so that each of the
    ``waiting`` starts gets a slot: one per start not already covered by one of the ``yielding``
    segments on their way out. A cancelled segment runs again later from scratch (same seed, same
    latents); the newest goes first."""
    return max(0, min(waiting - yielding, ahead))
