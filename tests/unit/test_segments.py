"""Segment scheduling and the cross-fade join; how text becomes segments is tests/unit/test_frontend.py."""

import numpy as np

from engine.chunking import ChunkSchedule
from engine.segments import Joiner, segment_schedule


def test_schedule_per_segment():
    rule, fixed = ChunkSchedule(3, 12), ChunkSchedule(3, 12, fixed=True)
    assert segment_schedule(0, rule, 2.5) == rule  # the first segment starts the listener's playback
    assert segment_schedule(2, rule, 2.5) == ChunkSchedule(3, 12, buffered=2.5)
    assert segment_schedule(2, rule, -0.3) == rule  # the listener ran dry: a fresh start
    assert segment_schedule(0, fixed, 2.5) == fixed
    assert segment_schedule(2, fixed, 2.5) == ChunkSchedule(12, 12, fixed=True)  # as before the rule


def reference_cross_fade(a, b, fade):
    fade = min(fade, len(a), len(b))
    ramp = np.linspace(0, 1, fade, dtype=np.float32)
    return np.concatenate([a[:-fade], a[-fade:] * (1 - ramp) + b[:fade] * ramp, b[fade:]])


def test_joiner_streams_equal_one_shot_cross_fade():
    rng = np.random.default_rng(0)
    segs = [rng.standard_normal(n).astype(np.float32) for n in (5000, 3000, 4000)]
    ref = reference_cross_fade(reference_cross_fade(segs[0], segs[1], 1200), segs[2], 1200)
    j, out = Joiner(1200), []
    for i, seg in enumerate(segs):
        j.start_segment()
        more = i < len(segs) - 1
        for part in np.array_split(seg, 4 if i != 1 else 7):  # chunks smaller than the fade too
            out.append(j.push(part, more))
    out.append(j.finish())
    got = np.concatenate(out)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_joiner_single_segment_passes_through():
    j = Joiner(1200)
    j.start_segment()
    x = np.arange(100, dtype=np.float32)
    assert np.array_equal(j.push(x, False), x) and j.finish().size == 0
