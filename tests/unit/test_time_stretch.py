"""engine.time_stretch on synthetic signals: the timing follows 1/speed (measured on the signal's
envelope, not on the output's length), the pitch stays (measured by FFT), streaming changes no bit, speed
1.0 is the input itself, and the output lags the input by no more than stated."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import PATCH_SAMPLES
from engine.params import DEFAULT_SCHEDULE, SPEED
from engine.protocol import SAMPLE_RATE
from engine.time_stretch import HOP, LOOKAHEAD, WINDOW, TimeStretch

SPEEDS = (0.25, 0.5, 1.5, 2.0, 4.0)
BURSTS = ((0.20, 0.55), (0.90, 1.15), (1.50, 1.85), (2.30, 2.60))  # seconds: where the tone sounds


def harmonic(seconds: float, f0: float, vibrato: float = 0.0) -> np.ndarray:
    """A voiced sound: f0 and 7 harmonics falling off as 1/h, optionally with a 5 Hz vibrato (a fraction of f0)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(f0 * (1 + vibrato * np.sin(2 * np.pi * 5 * t))) / SAMPLE_RATE
    return sum(np.sin(h * phase) / h for h in range(1, 9)) * 0.15


def bursts(f0: float = 180.0) -> np.ndarray:
    """The tone in BURSTS with 10 ms ramps, silence between: syllables, roughly."""
    x = harmonic(2.8, f0, vibrato=0.02)
    t = np.arange(x.size) / SAMPLE_RATE
    gate = sum(np.clip(np.minimum(t - a, b - t) / 0.01, 0, 1) for a, b in BURSTS)
    return (x * gate).astype(np.float32)


def stretch_whole(x: np.ndarray, speed: float) -> np.ndarray:
    ts = TimeStretch(speed)
    return np.concatenate([ts.push(x), ts.finish()])


def stretch_in(x: np.ndarray, speed: float, sizes) -> tuple[np.ndarray, list[np.ndarray]]:
    """``x`` pushed in pieces of ``sizes`` (cycled), then finished -> (all output, each call's output)."""
    ts, outs, i = TimeStretch(speed), [], 0
    for n in sizes:
        if i >= x.size:
            break
        outs.append(ts.push(x[i : i + n]))
        i += n
    assert i >= x.size
    outs.append(ts.finish())
    return np.concatenate(outs), outs


def burst_centres(y: np.ndarray) -> np.ndarray:
    """Energy centroid of each burst, in seconds: the sound's timing, whatever the output's length."""
    power = np.convolve(y.astype(np.float64) ** 2, np.ones(240) / 240, "same")  # 10 ms RMS
    loud = np.flatnonzero(power > 0.1 * power.max())
    gaps = np.flatnonzero(np.diff(loud) > SAMPLE_RATE // 20)  # quiet for 50 ms: the next burst
    starts, ends = loud[np.r_[0, gaps + 1]], loud[np.r_[gaps, loud.size - 1]] + 1
    assert starts.size == len(BURSTS)
    t = np.arange(y.size) / SAMPLE_RATE
    return np.array([(t[a:b] * power[a:b]).sum() / power[a:b].sum() for a, b in zip(starts, ends, strict=True)])


def dominant_frequency(y: np.ndarray) -> float:
    """Hz of the strongest FFT bin (Hann window; quadratic interpolation between bins)."""
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    k = int(np.argmax(spectrum[1:-1])) + 1
    a, b, c = np.log(spectrum[k - 1 : k + 2] + 1e-30)
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * SAMPLE_RATE / y.size


def schedule_sizes(total: int) -> list[int]:
    """The server's chunk sizes in samples: DEFAULT_SCHEDULE's first chunk, then its cap."""
    first, later = (n * PATCH_SAMPLES for n in (DEFAULT_SCHEDULE.first, DEFAULT_SCHEDULE.cap))
    return [first] + [later] * (total // later + 1)


@pytest.mark.parametrize("speed", (0.5, 1.5, 2.0))
def test_the_timing_follows_one_over_speed_within_3_percent(speed):
    x = bursts()
    y = stretch_whole(x, speed)
    assert y.size == round(x.size / speed)
    centres_in, centres_out = burst_centres(x), burst_centres(y)
    # every burst's position, and the span from the first to the last, scaled by 1/speed
    span = (centres_out[-1] - centres_out[0]) * speed / (centres_in[-1] - centres_in[0])
    assert abs(span - 1) < 0.03, span
    assert np.allclose(centres_out * speed, centres_in, rtol=0.03, atol=0)


@pytest.mark.parametrize("speed", (0.25, 4.0))
def test_the_extremes_run_and_keep_the_timing_roughly(speed):
    x = bursts()
    y = stretch_whole(x, speed)
    assert y.size == round(x.size / speed) and y.dtype == np.float32 and np.isfinite(y).all()
    assert np.allclose(burst_centres(y) * speed, burst_centres(x), rtol=0.05, atol=0)


@pytest.mark.parametrize("f0", (110.0, 240.0))  # a low and a high voice
@pytest.mark.parametrize("speed", SPEEDS)
def test_the_pitch_stays(speed, f0):
    x = harmonic(2.0, f0).astype(np.float32)
    y = stretch_whole(x, speed)
    # resampling (what changes the pitch) would move it to f0 * speed: 25% off at the nearest speed
    assert abs(dominant_frequency(y) / dominant_frequency(x) - 1) < 0.02
    # frames add up in phase: the energy stays on the harmonics (frames placed without the search, at
    # their nominal positions, smear it between them: 1-26% stays there on these tones)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size))) ** 2
    freqs = np.fft.rfftfreq(y.size, 1 / SAMPLE_RATE)
    near = np.zeros(freqs.size, bool)
    for h in range(1, 9):
        near |= np.abs(freqs - h * f0) < 0.03 * f0
    assert spectrum[near].sum() / spectrum.sum() > 0.95


@pytest.mark.parametrize("speed", SPEEDS)
def test_streamed_in_the_schedules_chunks_equals_whole_exactly(speed):
    x = bursts()
    whole = stretch_whole(x, speed)
    streamed, _ = stretch_in(x, speed, schedule_sizes(x.size))
    assert np.array_equal(streamed, whole)


@pytest.mark.parametrize("speed", (0.5, 2.0))
def test_streamed_in_ragged_chunks_equals_whole_exactly(speed):
    x = bursts()
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.choice([0, 1, 7, 359, 360, 721, 1200, 5000], size=4000)]
    streamed, _ = stretch_in(x, speed, sizes)
    assert np.array_equal(streamed, stretch_whole(x, speed))


def test_speed_1_returns_the_input_itself():
    x = bursts()
    ts = TimeStretch(1.0)
    chunks = [x[:11520], x[11520:11521], x[11521:]]
    outs = [ts.push(c) for c in chunks]
    assert all(out is c for out, c in zip(outs, chunks, strict=True))
    assert ts.finish().size == 0
    assert np.array_equal(np.concatenate(outs).view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("speed", SPEEDS)
def test_the_first_output_comes_within_the_lookahead_and_a_hop(speed):
    x = harmonic(0.5, 200.0).astype(np.float32)
    first = LOOKAHEAD + int(np.ceil(HOP * speed))  # 44 ms at 0.25 ... 100 ms at 4
    ts = TimeStretch(speed)
    assert ts.push(x[:HOP]).size == 0  # the first frame alone is not enough
    assert ts.push(x[HOP:first]).size > 0
    # the server's smallest first chunk (chunk_first=1: one patch) is answered at once, all but the lag
    assert TimeStretch(speed).push(x[:PATCH_SAMPLES]).size >= (PATCH_SAMPLES - LOOKAHEAD) / speed - HOP


@pytest.mark.parametrize("speed", SPEEDS)
def test_the_output_lags_the_input_by_at_most_the_lookahead_and_a_hop(speed):
    x = harmonic(1.5, 150.0).astype(np.float32)
    sizes = [int(n) for n in np.random.default_rng(5).integers(1, 2000, size=2000)]
    ts, received, sent = TimeStretch(speed), 0, 0
    for n in sizes:
        if received >= x.size:
            break
        sent += ts.push(x[received : received + n]).size
        received = min(x.size, received + n)
        assert sent >= (received - LOOKAHEAD) / speed - HOP
        assert sent <= received / speed  # never more than a stream ending here would have in all
    assert sent + ts.finish().size == round(x.size / speed)


@pytest.mark.parametrize("n", (0, 1, 100, WINDOW + 1))
@pytest.mark.parametrize("speed", (0.25, 2.0))
def test_short_inputs(n, speed):
    x = harmonic(0.1, 200.0)[:n].astype(np.float32)
    y = stretch_whole(x, speed)
    assert y.size == round(n / speed) and np.isfinite(y).all()


def test_bad_speeds_and_misuse():
    for bad in (0.2, 4.5, 0.0, -1.0):
        with pytest.raises(ValueError, match="speed"):
            TimeStretch(bad)
    assert (SPEED.low, SPEED.high, SPEED.default) == (0.25, 4.0, 1.0)
    ts = TimeStretch(2.0)
    ts.finish()
    with pytest.raises(RuntimeError):
        ts.push(np.zeros(10, np.float32))
    with pytest.raises(RuntimeError):
        ts.finish()
