"""bench.ceiling's ramp and its cost arithmetic, on hand-built levels and counters (no server)."""

from __future__ import annotations

import pytest

from bench.ceiling import MODELS, Snapshot, costs, judged, levels_to_run, peak_streams, rate_midpoint
from bench.load import StreamResult
from bench.openloop import Arrival, RateLevelResult, ScheduledStream


@pytest.mark.parametrize(
    ("limit", "start", "most", "bisect", "want"),
    [
        (100, 8, 256, 2, [8, 16, 32, 64, 128, 96, 112]),  # 64 passes, 128 fails: 96 passes, 112 fails
        (1000, 8, 256, 2, [8, 16, 32, 64, 128, 256]),  # every level passes: stops at the slot limit
        (200, 8, 200, 2, [8, 16, 32, 64, 128, 200]),  # the last level is the limit itself
        (5, 8, 256, 3, [8, 4, 6, 5]),  # the first level fails: bisected down from it
        (0, 1, 256, 2, [1]),  # nothing between 0 and 1
        (40, 8, 256, 0, [8, 16, 32, 64]),  # no bisection asked for
    ],
)
def test_levels_double_then_bisect(limit, start, most, bisect, want):
    assert levels_to_run(start, most, bisect, lambda n: n <= limit) == want


@pytest.mark.parametrize(
    ("limit", "start", "most", "bisect", "want"),
    [
        (3.0, 0.5, 64, 2, [0.5, 1, 2, 4, 3.0, 3.5]),  # 2/s passes, 4/s fails: 3/s passes, 3.5/s fails
        (0.3, 0.5, 64, 2, [0.5, 0.25, 0.38]),  # the first rate fails: bisected down from it, to 0.01/s
        (100, 1, 5, 1, [1, 2, 4, 5]),  # every rate passes: stops at the highest
        (0.0, 0.01, 1, 3, [0.01]),  # nothing between 0 and 0.01/s
    ],
)
def test_rates_double_then_bisect_to_a_hundredth(limit, start, most, bisect, want):
    assert levels_to_run(start, most, bisect, lambda r: r <= limit, rate_midpoint) == pytest.approx(want)


def counters(executions, requests, compute_ns, queue_ns) -> dict:
    return {"executions": executions, "requests": requests, "compute_ns": compute_ns, "queue_ns": queue_ns,
            "request_compute_ns": 0}  # fmt: skip


def test_costs_are_per_stream_step_and_per_chunk():
    zero = {m: counters(0, 0, 0, 0) for m in MODELS}
    cpu = {"tritonserver": 5.0, "generator": 1.0, "vocoder": 2.0, "tts": 3.0, "client": 0.5}
    window = {"tts_start_window": 32.0, "tts_start_late_chunks_total": 2.0, "tts_start_queued_rounds_total": 5.0}
    before = Snapshot(zero, 1.0, 10, 100, cpu, window)
    # 20 streams (20 generator requests: 0.2 s of execute, 0.4 s queued) stepped 400 times in 40 batched steps
    # (0.08 s in the step itself); 50 chunks
    stats = {**zero, "generator": counters(20, 20, 200_000_000, 400_000_000), "vocoder": counters(50, 50, 5e6, 1e7)}
    after = Snapshot(
        stats,
        1.08,
        50,
        500,
        {"tritonserver": 5.4, "generator": 1.2, "vocoder": 2.1, "tts": 3.5, "client": 0.6},
        {"tts_start_window": 46.0, "tts_start_late_chunks_total": 3.0, "tts_start_queued_rounds_total": 5.0},
    )
    c = costs(before, after)
    assert (c["stream_steps"], c["generator_steps"], c["chunks"], c["mean_batch"]) == (400, 40, 50, 10)
    assert c["generator_executes"] == 20
    assert c["generator_step_ms"] == pytest.approx(2.0)  # 80 ms over 40 steps
    assert c["generator_ms_per_stream_step"] == pytest.approx({"step": 0.2, "execute": 0.5, "queue": 1.0})
    assert c["vocoder_ms_per_chunk"] == pytest.approx({"execute": 0.1, "queue": 0.2})
    assert c["cpu_ms_per_stream_step"] == pytest.approx({"generator": 0.5, "tritonserver": 1.0})
    assert c["cpu_ms_per_chunk"] == pytest.approx({"vocoder": 2.0, "tts": 10.0, "client": 2.0})
    assert c["cpu_ms_per_stream_step_all"] == pytest.approx(1000 * 1.3 / 400)
    assert c["start_window"] == {"window": 46, "late_chunks_total": 1, "queued_rounds_total": 0}  # its end; counts


def test_a_rate_level_fails_on_a_failure_or_an_underrun_and_names_its_first_error():
    def level(*results):
        streams = tuple(ScheduledStream(Arrival(0.1 * i, "t", i), 0.1 * i, r) for i, r in enumerate(results))
        return RateLevelResult(2.0, 4.0, 5.0, streams)

    clean, stalled = StreamResult(0.1, 2.0, 7.68, None, 0.0), StreamResult(0.1, 2.0, 7.68, None, 0.02)
    busy = StreamResult(None, 0.01, 0.0, "ServerBusy: server busy", failure="busy")
    rows = [judged(lv.summary(), [s.result for s in lv.streams], {"mean_batch": 1.0})
            for lv in (level(clean, clean), level(clean, stalled), level(clean, busy))]  # fmt: skip
    assert [r["passed"] for r in rows] == [True, False, False]
    assert [r["first_error"] for r in rows] == [None, None, "ServerBusy: server busy"]
    assert rows[0]["rate"] == 2.0 and rows[0]["mean_batch"] == 1.0


def test_the_first_audio_rule_fails_a_rate_whose_p95_is_past_4_steps_and_200_ms():
    def level(first: float):
        results = [StreamResult(first, 8.0, 7.68, None, 0.0)] * 20
        streams = tuple(ScheduledStream(Arrival(0.1 * i, "t", i), 0.1 * i, r) for i, r in enumerate(results))
        return judged(RateLevelResult(2.0, 4.0, 5.0, streams).summary(), results, {"generator_step_ms": 80.0}, True)

    quick, slow = level(0.51), level(0.53)  # 4 x 80 ms + 200 ms = 520 ms
    assert quick["first_audio_limit_ms"] == pytest.approx(520.0) and quick["passed"] and not slow["passed"]
    assert slow["underruns"] == 0 and slow["errors"] == 0  # only the rule failed it
    plain = judged(RateLevelResult(2.0, 4.0, 5.0, ()).summary(), [], {"generator_step_ms": 80.0})
    assert "first_audio_limit_ms" not in plain


def test_an_open_loop_level_counts_the_most_streams_in_flight_at_once():
    assert peak_streams([]) == 0
    assert peak_streams([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (5.0, 6.0)]) == 2  # an end frees its place first
    assert peak_streams([(0.0, 10.0), (1.0, 2.0), (1.5, 3.0), (1.8, 9.0)]) == 4


def test_a_level_after_a_failed_one_runs_on_a_new_server(monkeypatch, capsys):
    """The levels' order 32, 64, 128 (fails), 96 (bisected): 96 gets a server of its own, started once
    128's is stopped, so it inherits no overload (its start window's back-off); a passing level's stays."""
    import contextlib
    import types

    import bench.ceiling as ceiling
    import bench.server

    events, served = [], []

    @contextlib.contextmanager
    def fake_server(*args, **kw):
        server = types.SimpleNamespace(ports=types.SimpleNamespace(grpc=len(served)), n=len(served))
        served.append(server)
        events.append(f"start {server.n}")
        yield server
        events.append(f"stop {server.n}")

    def fake_rate(server, client, rate, args, request):
        events.append(f"{rate:g} on {server.n}")
        numbers = dict.fromkeys(("underruns", "errors", "worst_gap_ms", "generator_step_ms", "mean_batch",
                                 "cpu_ms_per_stream_step_all", "load_average", "peak_streams"), 0)  # fmt: skip
        return {"rate": rate, "passed": rate <= 100, "first_error": "", **numbers}

    monkeypatch.setattr(bench.server, "local_server", fake_server)
    monkeypatch.setattr(ceiling, "TTSClient", lambda url, timeout: None)
    monkeypatch.setattr(ceiling, "one_stream", lambda *a, **k: types.SimpleNamespace(error="", audio=48 * 0.16))
    monkeypatch.setattr(ceiling, "measure_rate", fake_rate)
    monkeypatch.setattr(ceiling, "table", lambda rows, level: "")
    argv = ["--rate-start", "32", "--rate-max", "256", "--bisect", "1", "--client", "threads"]
    assert ceiling.main(argv) == 0
    assert events == ["start 0", "32 on 0", "64 on 0", "128 on 0", "stop 0", "start 1", "96 on 1", "stop 1"]
    assert "ceiling: 96 requests/s" in capsys.readouterr().out


def test_a_new_server_that_fails_its_warm_up_ends_the_run_with_the_levels_so_far(monkeypatch, capsys):
    import contextlib
    import types

    import bench.ceiling as ceiling
    import bench.server

    starts = []

    @contextlib.contextmanager
    def fake_server(*args, **kw):
        starts.append(len(starts))
        yield types.SimpleNamespace(ports=types.SimpleNamespace(grpc=0))

    def warm(*a, **k):  # the first server's warm-up stream plays; the second's fails
        return types.SimpleNamespace(error="" if len(starts) == 1 else "refused", audio=48 * 0.16)

    def fake_rate(server, client, rate, args, request):
        numbers = dict.fromkeys(("underruns", "errors", "worst_gap_ms", "generator_step_ms", "mean_batch",
                                 "cpu_ms_per_stream_step_all", "load_average", "peak_streams"), 0)  # fmt: skip
        return {"rate": rate, "passed": rate <= 40, "first_error": "", **numbers}

    monkeypatch.setattr(bench.server, "local_server", fake_server)
    monkeypatch.setattr(ceiling, "TTSClient", lambda url, timeout: None)
    monkeypatch.setattr(ceiling, "one_stream", warm)
    monkeypatch.setattr(ceiling, "measure_rate", fake_rate)
    monkeypatch.setattr(ceiling, "table", lambda rows, level: f"{len(rows)} levels")
    argv = ["--rate-start", "32", "--rate-max", "256", "--bisect", "1", "--client", "threads"]
    assert ceiling.main(argv) == 1  # 32 passed, 64 failed, 48 needed a new server, whose warm-up failed
    out, err = capsys.readouterr()
    assert "error: the warm-up stream failed: refused" in err
    assert "ceiling: 32 requests/s" in out and "2 levels" in out
