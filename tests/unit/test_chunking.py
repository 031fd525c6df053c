"""The chunk deadline rule (engine.chunking) over simulated step times: no model, no torch, milliseconds.

The listener here is written apart from the rule: it starts playing when the first chunk *arrives* and
stalls when a chunk arrives after everything before it has played.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.chunking import MARGIN, PATCH_SECONDS, ChunkClock, ChunkSchedule, Margin

RULE = ChunkSchedule(3, 12)


def run(schedule: ChunkSchedule, steps: list[float], margin: Margin = MARGIN) -> list[tuple[float, int]]:
    """One stream of len(steps) patches admitted at 0 s, step i taking steps[i] seconds -> its chunks as
    (cut time, patches); the last chunk is cut at the end whatever the rule says, as the generator does."""
    clock, now, pending, out = ChunkClock(schedule, 0.0, margin), 0.0, 0, []
    for i, took in enumerate(steps):
        now += took
        pending += 1
        if clock.due(pending, now) or i == len(steps) - 1:
            out.append((now, pending))
            pending = 0
    return out


def stalls(chunks: list[tuple[float, int]], steps: list[float], floor: float) -> list[float]:
    """Gaps a listener hears when the first chunk arrives as it is cut and every later one as late as
    the guarantee allows: one step (the next one: a step's chunks go out with the stream's next
    request) and ``floor`` seconds (vocoder, transport) after it was cut."""
    ends = np.cumsum(steps)
    gaps, playing_until = [], None
    for cut, patches in chunks:
        i = int(np.searchsorted(ends, cut - 1e-9))  # the step that ended at `cut`
        late = (steps[i + 1] if i + 1 < len(steps) else 0.0) + floor
        arrival = cut + (late if playing_until is not None else 0.0)
        if playing_until is not None and arrival > playing_until:
            gaps.append(arrival - playing_until)
        playing_until = max(arrival, playing_until or arrival) + patches * PATCH_SECONDS
    return gaps


def timed(r: float, patches: int, rng, jitter: float) -> list[float]:
    """Step times: r x 160 ms, each times (1 +- jitter), the first (the prefill) twice as long."""
    steps = list(r * PATCH_SECONDS * (1 + jitter * rng.uniform(-1, 1, patches)))
    steps[0] *= 2
    return steps


def sizes(chunks) -> list[int]:
    return [n for _, n in chunks]


def test_a_stream_that_keeps_up_never_underruns_with_the_first_chunk_as_its_only_buffer():
    """r = 0.9 with +-10 % jitter (every step under the 160 ms it adds), chunks arriving one step and the
    whole 100 ms floor late: no stall, in 200 seeded streams of 300 patches. A margin of two steps and
    no floor (no room for jitter or delivery) stalls them."""
    rng = np.random.default_rng(26)
    thin = 0
    for _ in range(200):
        steps = timed(0.9, 300, rng, 0.1)
        assert max(steps[1:]) < PATCH_SECONDS
        chunks = run(RULE, steps)
        assert chunks[0][1] == RULE.first and sum(sizes(chunks)) == 300
        assert stalls(chunks, steps, MARGIN.floor) == []
        thin += bool(stalls(run(RULE, steps, Margin(steps=2, floor=0.0)), steps, MARGIN.floor))
    assert thin > 100


def test_the_old_fixed_schedule_stalls_the_same_streams():
    """What the rule is for: (3, 12) fixed needs 12 patches in 480 ms, 4x real time; at r = 0.65 it stalls."""
    rng = np.random.default_rng(26)
    steps = timed(0.65, 48, rng, 0.1)
    assert stalls(run(ChunkSchedule(3, 12, fixed=True), steps), steps, MARGIN.floor)
    assert not stalls(run(RULE, steps), steps, MARGIN.floor)


def test_a_fast_stream_grows_its_chunks_to_the_cap():
    rng = np.random.default_rng(5)
    steps = timed(0.5, 120, rng, 0.1)
    got = sizes(run(RULE, steps))
    first_cap = got.index(RULE.cap)
    assert got[0] == RULE.first and first_cap <= 5
    assert got[1 : first_cap + 1] == sorted(got[1 : first_cap + 1])  # growing, after the first
    assert all(n == RULE.cap for n in got[first_cap:-1])


def test_a_stream_far_ahead_of_real_time_doubles_what_it_sent_up_to_the_cap():
    """Steps of 1 ms (the deadline never near): each later chunk holds as many patches as were sent
    before it, so the audio sent doubles per chunk, until the cap; a cap below that cuts at the cap."""
    steps = [0.01] + [0.001] * 99
    assert sizes(run(ChunkSchedule(3, 24), steps)) == [3, 3, 6, 12, 24, 24, 24, 4]
    assert sizes(run(ChunkSchedule(3, 12), steps)) == [3, 3, 6, 12, 12, 12, 12, 12, 12, 12, 4]
    assert sizes(run(ChunkSchedule(5, 8), steps)) == [5, 5] + [8] * 11 + [2]
    # no chunk after the first is larger than the audio sent before it
    for first, cap in ((3, 24), (1, 400), (7, 10)):
        got = sizes(run(ChunkSchedule(first, cap), steps))
        assert all(n <= max(first, sum(got[:k])) for k, n in enumerate(got) if k)


def test_a_later_segment_grows_from_what_the_listener_holds():
    """1.0 s held when a later segment starts (6.25 patches): its chunks double from there."""
    steps = [0.01] + [0.001] * 59
    assert sizes(run(ChunkSchedule(3, 24, buffered=1.0), steps)) == [6, 12, 24, 18]


def test_chunks_on_a_hand_built_trace():
    """Admitted at 0 s, a 200 ms prefill, then steps of 80 ms (r = 0.5). Margin: 3 x 80 ms + 100 ms = 340 ms.
    3 patches at 0.36 s (the first chunk; the listener holds 0.48 s); at 0.52 s it would hold
    0.32 s < 0.34 s: cut 2 (now 0.80 s sent); at 0.84 s it holds 0.32 s: cut 4 (1.44 s); 8 steps later it
    holds 0.32 s: cut 8 (2.72 s, holding 1.60 s); then 12 steps reach the cap before the deadline."""
    assert MARGIN.steps == 3 and MARGIN.floor == 0.1
    steps = [0.2] + [0.08] * 40
    chunks = run(RULE, steps)
    assert sizes(chunks) == [3, 2, 4, 8, 12, 12]
    assert [round(t, 2) for t, _ in chunks[:4]] == [0.36, 0.52, 0.84, 1.48]


def test_a_stream_slower_than_real_time_rebuffers_at_chunk_first_instead_of_one_patch_chunks():
    """r = 1.3: the listener stalls whatever we do; small chunks would only cost the front door more."""
    rng = np.random.default_rng(3)
    steps = timed(1.3, 90, rng, 0.1)
    chunks = run(RULE, steps)
    assert sizes(chunks) == [3] * 30
    assert stalls(chunks, steps, MARGIN.floor)  # it does stall: no schedule keeps up with r > 1


def test_a_listener_who_ran_dry_gets_a_fresh_start():
    """Fast, then a stall of 2 s (longer than all the audio sent), then fast again: the clock restarts
    at the re-buffering chunk, which is chunk_first patches, and the chunks grow again from there."""
    steps = [0.2] + [0.08] * 5 + [2.0] + [0.08] * 30
    clock, now, cuts = ChunkClock(RULE, 0.0), 0.0, []
    pending = 0
    for took in steps:
        now += took
        pending += 1
        if clock.due(pending, now):
            cuts.append((round(now, 2), pending))
            pending = 0
    # 2.60 s: dry (0.80 s sent since 0.36 s) with 2 patches gathered: no 2-patch chunk, 3 at 2.68 s
    assert cuts[:3] == [(0.36, 3), (0.52, 2), (2.68, 3)]
    assert clock.origin == pytest.approx(2.68) and max(n for _, n in cuts[3:]) > 3


def test_a_later_segment_starts_from_what_the_listener_holds():
    steps = [0.2] + [0.08] * 30
    assert sizes(run(ChunkSchedule(3, 12, buffered=3.0), steps))[0] == 12  # plenty held: straight to the cap
    assert sizes(run(ChunkSchedule(3, 12, buffered=0.0), steps))[0] == 3  # nothing held: a fresh start
    assert sizes(run(ChunkSchedule(3, 12, buffered=0.3), steps))[0] == 1  # about to run dry: at once


def test_the_cap_bounds_later_chunks_only():
    steps = [0.2] + [0.01] * 11
    assert sizes(run(ChunkSchedule(3, 1), steps)) == [3] + [1] * 9
    assert sizes(run(ChunkSchedule(3, 1, fixed=True), steps)) == [3] + [1] * 9


def test_fixed_gives_the_old_sizes_whatever_the_timing():
    rng = np.random.default_rng(1)
    for r in (0.2, 0.9, 2.0):
        assert sizes(run(ChunkSchedule(3, 12, fixed=True), timed(r, 40, rng, 0.5))) == [3, 12, 12, 12, 1]
        assert sizes(run(ChunkSchedule(2, 5, fixed=True), timed(r, 12, rng, 0.5))) == [2, 5, 5]


def test_steps_without_patches_are_timed_but_cut_nothing():
    clock = ChunkClock(RULE, 0.0)
    assert not clock.due(0, 0.5) and not clock.due(0, 0.6)
    assert clock.step == pytest.approx(0.1)  # the first step (a prefill) is not in the estimate


def test_bad_schedules_are_refused():
    for bad in ((0, 12), (3, 0)):
        with pytest.raises(ValueError, match="chunk schedule"):
            ChunkSchedule(*bad)
    with pytest.raises(ValueError, match="buffered"):
        ChunkSchedule(3, 12, buffered=-1.0)


def test_chunking_imports_no_torch():
    code = "import sys, engine.chunking; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_rest_is_not_a_step():
    """A paused stream's clock rests (engine.streams: a live stream not stepped); a 30 s pause between two
    100 ms steps leaves the step estimate at 100 ms, where counting it would have made it ~7.6 s."""
    rested, counted = ChunkClock(RULE, 0.0), ChunkClock(RULE, 0.0)
    for clock in (rested, counted):
        clock.due(0, 0.5)  # the first step (a prefill) is not in the estimate
        clock.due(0, 0.6)
    rested.rest(30.6)
    rested.due(0, 30.7)
    counted.due(0, 30.7)
    assert rested.step == pytest.approx(0.1) and rested.took == pytest.approx(0.1)
    assert counted.step > 7 and rested.keeping_up and not counted.keeping_up
