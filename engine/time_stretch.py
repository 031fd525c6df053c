"""Pitch-preserving speed change of a 24 kHz stream, chunk by chunk: WSOLA (numpy only, no torch).

WSOLA (waveform-similarity overlap-add, Verhelst and Roelands 1993) builds the output from Hann-windowed
frames of :data:`WINDOW` samples every :data:`HOP` samples. The frame centred on output sample ``k * HOP``
is read from the input centred near sample ``k * HOP * speed``, shifted by up to :data:`TOLERANCE`
samples to where the input looks most like the natural continuation of the frame before (normalized
cross-correlation), so that overlapping frames add up in phase: the waveform's periods are repeated or
skipped whole, and the pitch stays. The input is taken as silent before its start and after its end.

Why our own: no time-scale library is a dependency of this project (librosa, audiotsm and pytsmod are
absent, and pyrubberband drives the GPL ``rubberband`` binary, one process per call, which cannot be fed
a stream). The method is short, has no parameter a user must tune for speech, and written here it keeps
the properties a stream needs: a bounded lookahead, streamed output equal to the whole input's bit for
bit (every frame is computed from the same samples whatever the chunking), and speed 1.0 as no
processing at all.

Latency: the output lags the input by at most :data:`LOOKAHEAD` input samples (40 ms: the 30 ms window
and its 10 ms search range) plus one hop of output (15 ms): after ``n`` input samples at least
``(n - LOOKAHEAD) / speed - HOP`` output samples are out. So the first output needs at most
``LOOKAHEAD + HOP * speed`` input samples, 44 ms at speed 0.25 to 100 ms at 4, and a first chunk of one
patch (160 ms, the smallest ``chunk_first``) or more is answered at once: the first audio comes when it
would at speed 1.0.
"""

from __future__ import annotations

import numpy as np

from engine.params import SPEED

WINDOW = 720  # analysis window, samples (30 ms at 24 kHz): a few pitch periods of speech
HOP = WINDOW // 2  # output hop, samples (15 ms): Hann windows at half overlap add up to 1
TOLERANCE = 240  # search range either side of a frame's nominal position, samples (10 ms: a 100 Hz period)
LOOKAHEAD = WINDOW + TOLERANCE  # input a frame reads past its nominal centre, at most, samples (40 ms)
_HANN = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WINDOW) / WINDOW)  # periodic Hann: shifted by HOP, sums to 1
_SILENT = 1e-12  # a template with less energy than this (per sample) is silence: take the nominal position


class TimeStretch:
    """Plays a stream ``speed`` times as fast, keeping its pitch.

    ``push(chunk)`` takes the next (n,) float32 samples and returns the output samples that are final
    (possibly none); ``finish()`` returns the rest. The output has ``round(total input / speed)`` samples
    in all. Speed 1.0 returns every chunk as it came (the same array), and ``finish()`` nothing.
    """

    def __init__(self, speed: float):
        SPEED.check(speed)
        self.speed = float(speed)
        self.passthrough = self.speed == 1.0
        # Positions are in the input preceded by HOP zeros, so that frame k's centre, HOP past its start,
        # is input sample k * HOP * speed. The first HOP samples of output they make are dropped.
        self.input = np.zeros(HOP, np.float64)  # that padded input from position self.start on
        self.start = 0
        self.received = 0  # input samples pushed in all
        self.frame = 0  # index of the next frame
        self.previous = 0  # input position of the last frame placed
        self.overlap = np.zeros(WINDOW, np.float64)  # output from self.frame * HOP on, still being added to
        self.ready: list[np.ndarray] = []  # final output samples not handed out yet
        self.held = 0  # how many samples self.ready holds
        self.sent = 0  # output samples handed out
        self.finished = False

    def push(self, chunk: np.ndarray) -> np.ndarray:
        """The next input samples, (n,) float -> output samples that are final now, (m,) float32."""
        if self.finished:
            raise RuntimeError("push after finish")
        if self.passthrough:
            self.received += len(chunk)
            return chunk
        chunk = np.asarray(chunk, np.float64).reshape(-1)
        self.input = np.concatenate([self.input, chunk])
        self.received += chunk.size
        while self._needs(self.frame) <= HOP + self.received:
            self._place_frame()
        # never beyond what the shortest possible stream (this one, ending now) has in all
        return self._hand_out(int(np.floor(self.received / self.speed)))

    def finish(self) -> np.ndarray:
        """The rest of the output, (m,) float32: the input ends here (as if silence followed)."""
        if self.finished:
            raise RuntimeError("finish called twice")
        self.finished = True
        if self.passthrough:
            return np.zeros(0, np.float32)
        total = round(self.received / self.speed)
        while self.sent + self.held < total:
            missing = self._needs(self.frame) - (self.start + self.input.size)
            if missing > 0:
                self.input = np.concatenate([self.input, np.zeros(missing)])
            self._place_frame()
        return self._hand_out(total)

    def _nominal(self, k: int) -> int:
        """Frame k's input position before the search."""
        return round(k * HOP * self.speed)

    def _search(self, k: int) -> tuple[int, int]:
        """Frame k's candidate input positions, first and last."""
        nominal = self._nominal(k)
        return max(0, nominal - TOLERANCE), nominal + TOLERANCE

    def _needs(self, k: int) -> int:
        """How many input samples frame k reads (the candidates and the previous frame's continuation)."""
        if k == 0:
            return WINDOW
        return max(self._search(k)[1], self.previous + HOP) + WINDOW

    def _samples(self, begin: int, end: int) -> np.ndarray:
        """Input samples [begin, end) by absolute position, as a fresh array (the same values, the same
        arithmetic, however the input arrived)."""
        return self.input[begin - self.start : end - self.start].copy()

    def _place_frame(self) -> None:
        k = self.frame
        if k == 0:
            position = 0  # centred on input sample 0: half of it is the silence before the start
        else:
            lo, hi = self._search(k)
            template = self._samples(self.previous + HOP, self.previous + HOP + WINDOW)
            if template @ template < _SILENT * WINDOW:
                position = self._nominal(k)
            else:
                region = self._samples(lo, hi + WINDOW)
                correlation = np.correlate(region, template, "valid")  # (hi - lo + 1,)
                energy = np.cumsum(np.concatenate([[0.0], region * region]))
                energy = energy[WINDOW:] - energy[:-WINDOW]
                position = lo + int(np.argmax(correlation / np.sqrt(np.maximum(energy, 0.0) + _SILENT)))
        self.overlap += self._samples(position, position + WINDOW) * _HANN
        if k > 0:  # frame 0's first half is output before the input's start
            self.ready.append(self.overlap[:HOP].astype(np.float32))
            self.held += HOP
        self.overlap = np.concatenate([self.overlap[HOP:], np.zeros(HOP)])
        self.previous, self.frame = position, k + 1
        # what later frames can still read: the next continuation and the next candidates on
        keep = min(position + HOP, self._search(k + 1)[0])
        self.input, self.start = self.input[keep - self.start :], keep

    def _hand_out(self, limit: int) -> np.ndarray:
        """The ready samples up to output position ``limit``, (m,) float32."""
        ready = np.concatenate(self.ready) if self.ready else np.zeros(0, np.float32)
        n = max(0, min(ready.size, limit - self.sent))
        self.ready, self.held = ([ready[n:]], ready.size - n) if ready.size > n else ([], 0)
        self.sent += n
        return ready[:n]
