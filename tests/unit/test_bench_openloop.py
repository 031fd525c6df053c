"""The open-loop benchmark's schedule, stall accounting and summary, on hand-built traces and a fake client
(no server)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from bench.load import FAILURE_KINDS, StreamResult, failure_kind, one_stream, percentile, worst_gap
from bench.openloop import (
    MIXED_TEXTS,
    Arrival,
    RateLevelResult,
    ScheduledStream,
    continuous,
    poisson_arrivals,
    run_rate,
)
from bench.report import open_loop_markdown
from bench.request_options import chunk_parameters
from client import SAMPLE_RATE, InvalidRequest, ServerBusy, TTSError
from client.tts_client import Chunk


# ---- a trace of chunk arrivals -> what a listener hears ----
def heard(arrivals: list[float], seconds: list[float]) -> StreamResult:
    """A complete stream of these chunks (arrival s, audio s), judged as bench.load.one_stream judges it."""
    total = arrivals[-1] + 0.01
    return StreamResult(arrivals[0], total, sum(seconds), None, worst_gap(arrivals, seconds))


@pytest.mark.parametrize(
    ("arrivals", "seconds", "underrun", "gap_ms", "is_continuous"),
    [
        ([0.2, 0.5, 0.9], [0.48, 0.48, 0.48], False, 0, True),  # each chunk comes while the one before plays
        ([0.25, 0.75], [0.5, 0.5], False, 0, True),  # the next chunk exactly when the first runs out
        ([0.25, 0.85], [0.5, 0.5], True, 100, True),  # a 100 ms wait is still continuous
        ([1.0, 1.6], [0.5, 0.5], True, 100, True),  # so is 100 ms that floats make 100.00000000000009
        ([0.25, 0.851], [0.5, 0.5], True, 101, False),  # 101 ms is not
        # the first stall (300 ms) delays playback: the third chunk, 0.9 s after the second, finds 0.4 s of it
        # still to play (heard until 1.5 s), so only the 300 ms stall counts
        ([0.0, 0.8, 1.1], [0.5, 0.4, 0.5], True, 300, False),
        ([0.0, 0.55, 1.6], [0.5, 0.5, 0.5], True, 550, False),  # 50 ms, then 550 ms: the worst is reported
    ],
)
def test_a_trace_gives_underrun_worst_gap_and_continuity(arrivals, seconds, underrun, gap_ms, is_continuous):
    stream = heard(arrivals, seconds)
    assert (stream.worst_gap > 0) == underrun
    assert 1000 * stream.worst_gap == pytest.approx(gap_ms, abs=1e-6)
    assert continuous(stream) == is_continuous


def test_a_failed_stream_is_never_continuous():
    assert not continuous(StreamResult(0.1, 1.0, 0.5, "TimeoutError: late", 0.0, "timeout"))


# ---- failures by kind ----
@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ServerBusy("server busy: 12 requests are running or waiting"), "busy"),
        (InvalidRequest("max_patches must be >= 1"), "invalid"),
        (ConnectionError("server unavailable: failed to connect"), "unavailable"),
        (TTSError("the generator failed"), "error"),
        (RuntimeError("the stream ended without audio"), "error"),
        (TimeoutError("no response from the server for 60 s"), "timeout"),
        # the kind is the exception's, not its words
        (TTSError("unavailable: busy"), "error"),
        (ServerBusy("invalid input"), "busy"),
    ],
)
def test_failure_kind_follows_the_exception_type_and_tag(exc, kind):
    assert failure_kind(exc) == kind


class FakeClient:
    """TTSClient's stream(): each text maps to ([(arrival s, samples), ...], an exception raised after them or
    None). With a ``gate``, every stream waits (up to 5 s, then fails) until ``starts_to_open`` have started;
    ``pause_s`` passes between a stream's chunks."""

    def __init__(self, plans: dict, gate: threading.Event | None = None, starts_to_open: int = 0, pause_s=0.0):
        self.plans, self.gate, self.starts_to_open, self.pause_s = plans, gate, starts_to_open, pause_s
        self.started, self.lock = 0, threading.Lock()

    def stream(self, text, seed=None, **request):
        with self.lock:
            self.started += 1
            if self.gate is not None and self.started >= self.starts_to_open:
                self.gate.set()
        if self.gate is not None and not self.gate.wait(5):
            raise RuntimeError(f"only {self.started} streams started")
        chunks, exc = self.plans[text]
        for i, (arrival, samples) in enumerate(chunks):
            if i:
                time.sleep(self.pause_s)
            yield Chunk(np.zeros(samples, np.float32), arrival)
        if exc is not None:
            raise exc


def test_one_stream_records_the_failure_kind_and_keeps_complete_streams_clean():
    client = FakeClient({"ok": ([(0.1, 2400), (0.2, 2400)], None), "busy": ([], ServerBusy("server busy")),
                         "cut": ([(0.1, 2400)], TimeoutError("no response"))})  # fmt: skip
    ok, busy, cut = (one_stream(client, t, 0, {}) for t in ("ok", "busy", "cut"))
    assert ok.error is None and ok.failure is None and ok.audio == pytest.approx(0.2) and ok.first_chunk == 0.1
    assert busy.failure == "busy" and busy.first_chunk is None
    assert cut.failure == "timeout" and cut.audio == pytest.approx(2400 / SAMPLE_RATE)


# ---- the Poisson schedule ----
def test_the_schedule_is_seeded_and_poisson():
    rate, duration = 2.0, 2000.0
    arrivals = poisson_arrivals(rate, duration, seed=7)
    assert arrivals == poisson_arrivals(rate, duration, seed=7)
    assert arrivals != poisson_arrivals(rate, duration, seed=8)
    # a Poisson count over 2,000 s at 2/s has mean 4,000 and standard deviation sqrt(4,000) = 63: 5 sd
    assert abs(len(arrivals) - rate * duration) < 5 * np.sqrt(rate * duration)
    times = np.array([a.at for a in arrivals])
    assert np.all(np.diff(times) > 0) and times[0] >= 0 and times[-1] < duration
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.05)
    assert np.std(gaps) == pytest.approx(1 / rate, rel=0.1)  # exponential: sd = mean (a fixed pace has sd 0)
    assert np.mean(gaps < 0.1 / rate) == pytest.approx(1 - np.exp(-0.1), abs=0.02)  # P(gap < 0.1 mean)
    assert [a.seed for a in arrivals[:3]] == [0, 1, 2]
    picked = {a.text for a in arrivals}
    assert picked == set(MIXED_TEXTS)
    with pytest.raises(ValueError):
        poisson_arrivals(0, 10, 0)


def test_the_mixed_texts_hold_short_replies_and_paragraphs_in_english_and_chinese():
    chinese = [t for t in MIXED_TEXTS if any("\u4e00" <= c <= "\u9fff" for c in t)]
    english = [t for t in MIXED_TEXTS if t not in chinese]
    for texts in (chinese, english):
        sentences = [sum(t.count(c) for c in ".?!。？！") for t in texts]
        assert min(sentences) == 1 and max(sentences) >= 4, texts


def test_arrivals_start_on_schedule_while_earlier_streams_still_run():
    """Five streams that each block until all five have started: a loop that waited for a completion before
    its next arrival would never get there, and its streams would be cut as timeouts."""
    gate = threading.Event()
    client = FakeClient({"t": ([(0.05, 2400), (0.1, 2400)], None)}, gate, starts_to_open=5)
    arrivals = [Arrival(0.02 * i, "t", i) for i in range(5)]
    level = run_rate(client, arrivals, rate=50, duration=0.1, request={}, drain_timeout=5)
    assert gate.is_set()
    assert [s.arrival.seed for s in level.streams] == [0, 1, 2, 3, 4]
    assert all(s.result.error is None for s in level.streams), [s.result.error for s in level.streams]
    assert all(s.sent >= s.arrival.at for s in level.streams)


def test_streams_still_running_after_the_drain_timeout_are_cut_as_timeouts():
    client = FakeClient({"t": ([(0.05, 2400), (1.0, 2400), (1.05, 2400)], None)}, pause_s=0.5)
    arrivals = [Arrival(0.0, "t", 0), Arrival(0.02, "t", 1)]
    level = run_rate(client, arrivals, rate=1, duration=0.05, request={}, drain_timeout=0.1)
    assert [s.result.failure for s in level.streams] == ["timeout", "timeout"]  # complete, given 1 s
    assert all(s.result.audio == pytest.approx(0.1) for s in level.streams)  # one chunk each before the cut


# ---- the summary ----
def scheduled(i: int, result: StreamResult, at: float = 0.0, sent: float | None = None) -> ScheduledStream:
    return ScheduledStream(Arrival(at, "t", i), at if sent is None else sent, result)


def test_the_summary_counts_rates_percentiles_stalls_and_failures():
    ok = [  # first audio 100..400 ms; RTF 0.5, 0.5, 1.0, 1.5; gaps 0, 0, 100 ms, 250 ms
        StreamResult(0.1, 1.0, 2.0, None, 0.0), StreamResult(0.2, 1.0, 2.0, None, 0.0),
        StreamResult(0.3, 2.0, 2.0, None, 0.1), StreamResult(0.4, 3.0, 2.0, None, 0.25),
    ]  # fmt: skip
    failed = [
        StreamResult(None, 0.01, 0.0, "ServerBusy: full", failure="busy"),
        StreamResult(None, 0.01, 0.0, "ServerBusy: full", failure="busy"),
        StreamResult(0.5, 9.0, 0.5, "TimeoutError: late", failure="timeout"),
        StreamResult(None, 0.01, 0.0, "InvalidRequest: no", failure="invalid"),
    ]
    streams = [scheduled(i, r, at=0.5 * i, sent=0.5 * i + 0.002 * (i == 3)) for i, r in enumerate(ok + failed)]
    row = RateLevelResult(rate=2.0, duration=4.0, wall=8.0, streams=tuple(streams)).summary()
    assert (row["requests"], row["complete"], row["errors"]) == (8, 4, 4)
    assert row["offered_rps"] == pytest.approx(2.0)  # 8 arrivals in 4 s
    assert row["achieved_rps"] == pytest.approx(0.5)  # 4 complete streams in 8 s
    # linear between ranks: p50 of 100..400 is 250; p95 is 300 + 0.85 x 100; p99 300 + 0.97 x 100
    assert row["first_chunk_ms"]["p50"] == pytest.approx(250)
    assert row["first_chunk_ms"]["p95"] == pytest.approx(385)
    assert row["first_chunk_ms"]["p99"] == pytest.approx(397)
    assert row["rtf"]["p50"] == pytest.approx(0.75) and row["rtf"]["p95"] == pytest.approx(1.425)
    assert row["underruns"] == 2 and row["worst_gap_ms"] == pytest.approx(250)
    assert row["continuity_ok_rate"] == pytest.approx(0.75)  # the 100 ms gap passes, the 250 ms one does not
    assert row["failures"] == {"busy": 2, "invalid": 1, "unavailable": 0, "error": 0, "timeout": 1}
    assert row["start_lag_ms_max"] == pytest.approx(2.0)
    table = open_loop_markdown([row], "t", [])
    assert "| busy | invalid | unavailable | error | timeout |" in table
    assert "| 2 | 8 | 4 | 0.50 | 250 | 385 | 397 | 0.750 | 1.425 | 2 | 75 % | 250 | 2 | 1 | 0 | 0 | 1 |" in table


def test_a_level_with_no_complete_stream_reports_no_latency_rather_than_zero():
    busy = StreamResult(None, 0.01, 0.0, "ServerBusy: full", failure="busy")
    row = RateLevelResult(1.0, 2.0, 0.01, (scheduled(0, busy),)).summary()
    assert row["achieved_rps"] == 0 and np.isnan(row["first_chunk_ms"]["p50"]) and np.isnan(row["continuity_ok_rate"])
    assert "| n/a |" in open_loop_markdown([row], "t", [])


def test_percentile_interpolates_between_ranks():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([10, 20], 95) == pytest.approx(19.5)
    assert np.isnan(percentile([], 50))
    assert set(FAILURE_KINDS) == {"busy", "invalid", "unavailable", "error", "timeout"}


# ---- the command lines ----
def test_chunk_fixed_is_sent_only_when_asked_for():
    from bench.__main__ import parse_args

    assert chunk_parameters(parse_args(["--rate", "1"])) == {}  # a server that predates it refuses unknown ones
    args = parse_args(["--rate", "0.5,2", "--chunk-fixed", "--chunk-first", "3", "--chunk-next", "12"])
    assert chunk_parameters(args) == {"chunk_first": 3, "chunk_next": 12, "chunk_fixed": True}
    assert args.rates == [0.5, 2.0] and args.duration == 60 and args.seed == 0


@pytest.mark.parametrize("argv", [["--rate", "1", "--concurrency", "4"], ["--rate", "0,1"], ["--rate", "x"],
                                  ["--rate", "1", "--duration", "0"]])  # fmt: skip
def test_bad_open_loop_command_lines_are_refused(argv, capsys):
    from bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert "--rate" in err or "--duration" in err, err


def test_the_closed_loop_command_line_is_as_it_was():
    from bench.__main__ import parse_args

    args = parse_args([])
    assert args.rates is None and args.levels == [1, 2, 4, 8, 16] and chunk_parameters(args) == {}
