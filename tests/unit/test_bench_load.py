"""The load benchmark's underrun accounting, on arrival times worked out by hand."""

from __future__ import annotations

import pytest

from bench.load import LevelResult, StreamResult, worst_gap
from bench.report import markdown


@pytest.mark.parametrize(
    ("arrivals", "seconds", "gap"),
    [
        ([1.0], [0.5], 0.0),  # one chunk: nothing to wait for
        ([1.0, 1.1, 1.2], [0.5, 0.5, 0.5], 0.0),  # each chunk comes while the one before still plays
        ([1.0, 1.5], [0.5, 0.5], 0.0),  # just in time is in time
        ([1.0, 2.0], [0.5, 0.5], 0.5),  # silent from 1.5 s to 2.0 s
        ([0.0, 1.0, 1.2], [0.5, 0.1, 0.1], 0.5),  # 0.5 s, then 0.1 s: the worst is reported
        # the stall delays what follows: the third chunk (0.6 s) comes before the second ends playing (0.7 s),
        # though 0.5 s of audio had come by 0.6 s after the first
        ([0.0, 0.4, 0.6], [0.2, 0.3, 0.1], 0.2),
    ],
)
def test_worst_gap(arrivals, seconds, gap):
    assert worst_gap(arrivals, seconds) == pytest.approx(gap)


def test_the_level_counts_streams_with_an_underrun_and_the_table_shows_them():
    streams = (StreamResult(0.1, 2.0, 1.6, None, 0.0), StreamResult(0.2, 2.5, 1.6, None, 0.25),
               StreamResult(0.3, 2.0, 1.6, None, 0.05), StreamResult(None, 1.0, 0.0, "Busy: full", 0.0))  # fmt: skip
    row = LevelResult(4, 3.0, streams).summary()
    assert row["underruns"] == 2 and row["worst_gap_ms"] == pytest.approx(250.0) and row["errors"] == 1
    table = markdown([row], "t", [])
    assert "| underrun streams | worst gap (ms) |" in table and "| 2 | 250 |" in table
