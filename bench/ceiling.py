"""``python -m bench.ceiling``: the serving ceiling, the most concurrent streams that stay real time when
the model itself costs nothing.

It starts the real server (``tts``, ``prompt_encoder``, the ``generator`` and its engine thread, the
``vocoder``, gRPC) with ``--synthetic-math`` (:mod:`engine.synthetic`: ready-made latents
and audio instead of the networks; the tiny checkpoint's prompt encoder stays real) and streams through
the bundled asyncio client from a process of its own (:mod:`bench.aio_load`: one event loop, one gRPC
channel; ``--client threads``: a thread and a channel per stream in this process, which at hundreds of
streams costs more CPU than the server it measures). At each level N it starts N streams at once, each of ``--patches`` patches, and
judges each as a listener would: playing it from its first chunk on, that chunk the only buffer, a
chunk that comes after the audio before it has run out is an underrun (``bench.load.worst_gap``). A
level passes when no stream fails and none underruns; every stream was then at least real time (6.25
patches/s) after its first chunk. Levels double from ``--start`` until one fails (or ``--slots``, the
server's limit, is reached); ``--bisect`` more levels then narrow the step between the last pass and
the first failure. The ceiling is the largest level that passed. A level after a failed one runs on a new
server, so that no level inherits another's overload (its start window backed off, and capped for a minute).

With ``--real`` the preset's networks step instead of the synthetic math, on ``--device`` (``--preset full``: the
checkpoint :mod:`bench.full_size` writes): the ceiling of a model, which ``bench/gpu.sh --triton`` runs on a GPU.

The server's start window (``--start-rate``, engine.start_window) bounds the requests between their start and
their first audio (``--start-rate 0``: no window, to compare): without it, a level's streams all start together and
the ones that got their first chunk early stall (docs/serving.md, Starts under load).

With ``--rate-start R`` the levels are arrival rates instead (open loop, :mod:`bench.openloop`): at each
rate, streams of the same length arrive on a seeded Poisson schedule for ``--duration`` s, whether or not
earlier ones have finished; rates double from R up to ``--rate-max``, then bisect the same way. A level
passes on the same terms; the ceiling is the largest rate with no failure and no underrun.
``--first-audio-rule`` adds the headline's (docs/benchmarks.md): first audio p95 within 4 generator steps
(the rate's mean step, as measured) + 200 ms.

The server's default chunks follow the listener's deadline (docs/serving.md, Chunk sizes). With a fixed
schedule of 3, then 12 patches (``--chunk-fixed --chunk-next 12``) the second chunk must come within the
first one's 0.48 s: 12 patches at 4x real time; ``--chunk-first/--chunk-next 12`` ask for real time only.

What each part costs, per level, from Triton's per-model statistics (``/v2/models/stats``: compute and
queue time over the requests the model took: streams for the generator, chunks for the vocoder), the
generator's own step histogram (``tts_generator_step_seconds``) and count of streams stepped
(``tts_generator_stream_steps_total``: stream-steps, and their mean batch) and the CPU time of every process
(``/proc``: tritonserver itself, each model's Python stub with its threads, and this client). The table
goes to stdout, progress to stderr, all numbers to ``--json``.
Past 300 lines on purpose: one benchmark (levels of concurrent streams judged as a listener would, the CPU
each process spent, one table), whose parts share its server and snapshots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.aio_load import LoadProcess
from bench.load import LevelResult, StreamResult, console_progress, one_stream, run_level
from bench.openloop import add_open_loop_options, poisson_arrivals, run_rate
from bench.request_options import add_chunk_options, chunk_parameters
from client import TTSClient
from serving.config.options import MAX_SLOTS, ServeOptions

PATCHES_PER_SECOND = 6.25  # real time: one 160 ms patch per 160 ms
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Please hold the line, your call is important to us."]
MODELS = ("tts", "prompt_encoder", "generator", "vocoder")
STEP = "tts_generator_step_seconds"
STREAM_STEPS = "tts_generator_stream_steps_total"  # streams stepped, summed over the steps
WINDOW = "tts_start_"  # the start window: its size at a level's end, its signals during it (docs/serving.md)


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters at one moment."""

    stats: dict  # model -> {"executions", "requests", "compute_ns", "queue_ns"} (Triton's statistics)
    step_sum: float  # seconds in the generator's step histogram
    step_count: float  # steps it counted
    stream_steps: float  # streams stepped, summed over those steps
    cpu: dict  # process ("tritonserver", a model's name, "client") -> CPU seconds
    window: dict  # the start window's tts_start_* metrics (its size, late chunks, rounds with a queue)


def model_stats(server) -> dict:
    url = f"http://127.0.0.1:{server.ports.http}/v2/models/stats"
    request = urllib.request.Request(url, headers={"admin-key": server.triton_key})  # statistics are restricted
    with urllib.request.urlopen(request, timeout=10) as r:
        raw = json.loads(r.read())["model_stats"]
    out = {}
    for m in raw:
        name = "generator" if m["name"] == server.generator_model else m["name"]
        # per request, compute_infer is its whole batch's execute: the executes' own sum is in batch_stats
        execute_ns = sum(int(b["compute_infer"]["ns"]) for b in m.get("batch_stats", []))
        out[name] = {"executions": int(m["execution_count"]), "requests": int(m["inference_count"]),
                     "compute_ns": execute_ns, "queue_ns": int(m["inference_stats"]["queue"]["ns"]),
                     "request_compute_ns": int(m["inference_stats"]["compute_infer"]["ns"])}  # fmt: skip
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(server) -> dict:
    """CPU seconds of tritonserver and of each model's stubs together (named by its model folder)."""
    root = server.proc.pid
    out = {"tritonserver": cpu_seconds(root)}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid != root:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            model = Path(argv[1].decode()).parent.parent.name  # .../model_repository/NAME/1/model.py
            model = "generator" if model == server.generator_model else model  # (tts may have several)
            out[model] = out.get(model, 0.0) + cpu_seconds(int(entry.name))
        except (OSError, IndexError, ValueError):  # a process that just ended
            continue
    return out


def snapshot(server, load: LoadProcess | None = None) -> Snapshot:
    """``load``: the load process, whose CPU counts as the client's with this one's."""
    metrics = server.metrics((STEP, STREAM_STEPS, WINDOW))
    cpu = server_cpu(server) | {"client": time.process_time() + (cpu_seconds(load.pid) if load else 0.0)}
    return Snapshot(model_stats(server), metrics.get(f"{STEP}_sum", 0.0), metrics.get(f"{STEP}_count", 0.0),
                    metrics.get(STREAM_STEPS, 0.0), cpu, {k: v for k, v in metrics.items() if k.startswith(WINDOW)})  # fmt: skip


def costs(before: Snapshot, after: Snapshot) -> dict:
    """What one level cost: per stream-step (generator) and per chunk (vocoder, tts, client), in ms."""
    d = {m: {k: after.stats[m][k] - before.stats[m][k] for k in after.stats[m]} for m in MODELS}
    cpu = {k: after.cpu[k] - before.cpu.get(k, 0.0) for k in after.cpu}
    stepped = after.stream_steps - before.stream_steps
    stream_steps, chunks = max(1.0, stepped), max(1, d["vocoder"]["requests"])
    steps = max(1.0, after.step_count - before.step_count)
    return {
        "stream_steps": stepped,
        "generator_steps": after.step_count - before.step_count,
        "generator_executes": d["generator"]["executions"],
        "chunks": d["vocoder"]["requests"],
        "mean_batch": stepped / steps,
        "generator_step_ms": 1000 * (after.step_sum - before.step_sum) / steps,  # in-model, per batched step
        # in-model step (histogram); Triton's execute and queue time of the generator's requests (one per
        # stream: what Triton spends per stream, spread over its steps)
        "generator_ms_per_stream_step": {
            "step": 1000 * (after.step_sum - before.step_sum) / stream_steps,
            "execute": d["generator"]["compute_ns"] / 1e6 / stream_steps,
            "queue": d["generator"]["queue_ns"] / 1e6 / stream_steps,
        },
        "vocoder_ms_per_chunk": {
            "execute": d["vocoder"]["compute_ns"] / 1e6 / chunks,
            "queue": d["vocoder"]["queue_ns"] / 1e6 / chunks,
        },
        "cpu_ms_per_stream_step": {k: 1000 * cpu.get(k, 0.0) / stream_steps for k in ("generator", "tritonserver")},
        "cpu_ms_per_chunk": {k: 1000 * cpu.get(k, 0.0) / chunks for k in ("vocoder", "tts", "client")},
        "cpu_ms_per_stream_step_all": 1000 * sum(cpu.values()) / stream_steps,
        "cpu_s": cpu,
        # the window's size at the level's end; its late chunks and rounds with a queue during the level
        "start_window": {
            k.removeprefix(WINDOW): v - (0 if k.endswith("window") else before.window.get(k, 0))
            for k, v in after.window.items()
        },
    }


def measure(server, client: TTSClient | LoadProcess, n: int, request: dict) -> dict:
    """n streams at once -> the level's row (listener summary, costs, passed). ``client``: the load process
    (one asyncio loop, :mod:`bench.aio_load`) or a client for a thread per stream (:mod:`bench.load`)."""
    load = client if isinstance(client, LoadProcess) else None
    before = snapshot(server, load)
    if load:
        level: LevelResult = load.level(n, n, TEXTS, request)
    else:
        level = run_level(client, n, n, TEXTS, request, progress=console_progress(n))
    return judged(level.summary(), level.streams, costs(before, snapshot(server, load)))


def measure_rate(server, client: TTSClient | LoadProcess, rate: float, args: argparse.Namespace,
                 request: dict) -> dict:  # fmt: skip
    """Poisson arrivals at ``rate`` requests/s for ``args.duration`` s -> the level's row, as :func:`measure`."""
    arrivals = poisson_arrivals(rate, args.duration, args.seed, tuple(TEXTS))
    load = client if isinstance(client, LoadProcess) else None
    before = snapshot(server, load)
    if load:
        level = load.rate(arrivals, rate, args.duration, request, args.drain_timeout)
    else:
        level = run_rate(client, arrivals, rate, args.duration, request, args.drain_timeout,
                         console_progress(f"rate {rate:g}/s"))  # fmt: skip
    row = judged(level.summary(), [s.result for s in level.streams], costs(before, snapshot(server, load)),
                 args.first_audio_rule)  # fmt: skip
    row["peak_streams"] = peak_streams([(s.sent, s.sent + s.result.total) for s in level.streams])
    return row


def peak_streams(spans: Sequence[tuple[float, float]]) -> int:
    """The most streams in flight at once, from each one's (sent, ended) seconds: an open-loop rate's
    concurrency (an end at the same instant as a start frees its place first)."""
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def judged(summary: dict, streams: Sequence[StreamResult], cost: dict, first_audio_rule: bool = False) -> dict:
    """A level's row: its listener summary, what it cost, and whether it passed (no failure, no underrun;
    with ``first_audio_rule`` also first audio p95 within 4 of the level's mean generator steps + 200 ms)."""
    row = {**summary, **cost}
    row["passed"] = row["errors"] == 0 and row["underruns"] == 0
    if first_audio_rule:
        row["first_audio_limit_ms"] = 4 * row["generator_step_ms"] + 200
        row["passed"] = row["passed"] and row["first_chunk_ms"]["p95"] <= row["first_audio_limit_ms"]
    row["first_error"] = next((s.error for s in streams if s.error), None)
    row["load_average"] = os.getloadavg()[0]
    return row


def int_midpoint(good: int, bad: int) -> int:
    return (good + bad) // 2


def rate_midpoint(good: float, bad: float) -> float:
    """Halfway, to 0.01 requests/s: finer steps than that are lost in the run-to-run noise."""
    return round((good + bad) / 2, 2)


def levels_to_run(start, most, bisect: int, passed, midpoint=int_midpoint) -> list:
    """Doubling from ``start`` up to ``most`` while ``passed(n)``, then ``bisect`` midpoints between the
    last pass and the first failure (0 if the first level failed). ``passed`` runs a level; ``midpoint``
    picks the level between two (:func:`int_midpoint` for streams, :func:`rate_midpoint` for rates);
    returns the levels run, in order."""
    ran, good, bad, n = [], 0, None, start
    while True:
        ran.append(n)
        if not passed(n):
            bad = n
            break
        good = n
        if n >= most:
            break
        n = min(2 * n, most)
    for _ in range(bisect if bad is not None else 0):
        mid = midpoint(good, bad)
        if mid in (good, bad) or mid <= 0:
            break
        ran.append(mid)
        good, bad = (mid, bad) if passed(mid) else (good, mid)
    return ran


def ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def table(rows: list[dict], level: str = "concurrency") -> str:
    """``level``: ``concurrency`` (streams) or ``rate`` (requests/s), the key the rows are levels of."""
    head = ["streams" if level == "concurrency" else "req/s (peak streams)", "result", "errors", "underruns", "worst gap ms",
            "first chunk p50 / p90 ms", "mean batch",
            "generator step ms", "generator ms per stream-step: step / execute / queue",
            "vocoder ms per chunk: execute / queue", "CPU ms per stream-step: generator / tritonserver",
            "CPU ms per chunk: vocoder / tts / client", "CPU ms per stream-step, all"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: r[level]):
        g, v = r["generator_ms_per_stream_step"], r["vocoder_ms_per_chunk"]
        cs, cc = r["cpu_ms_per_stream_step"], r["cpu_ms_per_chunk"]
        worst = "–" if r["worst_gap_ms"] != r["worst_gap_ms"] else f"{r['worst_gap_ms']:.0f}"
        at = f"{r[level]:g}" + (f" ({r['peak_streams']})" if "peak_streams" in r else "")
        cells = [at, "pass" if r["passed"] else "FAIL", str(r["errors"]),
                 f"{r['underruns']}/{r['requests']}", worst,
                 f"{r['first_chunk_ms']['p50']:.0f} / {r['first_chunk_ms']['p90']:.0f}", f"{r['mean_batch']:.1f}",
                 ms(r["generator_step_ms"]), " / ".join(ms(g[k]) for k in ("step", "execute", "queue")),
                 " / ".join(ms(v[k]) for k in ("execute", "queue")),
                 " / ".join(ms(cs[k]) for k in ("generator", "tritonserver")),
                 " / ".join(ms(cc[k]) for k in ("vocoder", "tts", "client")),
                 ms(r["cpu_ms_per_stream_step_all"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=8, help="the first level, in concurrent streams (default 8)")
    ap.add_argument("--slots", type=int, default=512, help="generator slots: the highest level (default 512)")
    ap.add_argument("--bisect", type=int, default=2, help="levels run between the last pass and the first failure")
    ap.add_argument("--patches", type=int, default=48, help="patches per stream, 160 ms each (default 48)")
    add_chunk_options(ap)
    ap.add_argument(
        "--rate-start",
        type=float,
        help="open loop: the first level, in requests/s (Poisson arrivals; default: closed loop)",
    )
    ap.add_argument("--rate-max", type=float, default=64.0, help="open loop: the highest rate, requests/s (default 64)")
    add_open_loop_options(ap)
    ap.add_argument(
        "--preset",
        choices=["tiny", "small", "full"],
        default="tiny",
        help="checkpoint of the prompt encoder (with --real: of every model; full: bench.full_size's)",
    )
    ap.add_argument(
        "--real",
        action="store_true",
        help="the preset's real networks step (no --synthetic-math): the ceiling of a model on --device",
    )
    ap.add_argument("--device", default="cpu", help="the server's --device (default cpu; cuda with --real on a GPU)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response")
    ap.add_argument("--client", choices=["aio", "threads"], default="aio",
                    help="the load: one asyncio loop in a process of its own, every stream on one gRPC channel "
                    "(default), or a thread and a channel per stream in this process")  # fmt: skip
    ap.add_argument("--start-rate", type=float, default=ServeOptions.start_rate,
                    help="the server's --start-rate: the starts a second its start window is sized for "
                    f"(default {ServeOptions.start_rate:g}; 0: no window, to compare)")  # fmt: skip
    ap.add_argument(
        "--step-budget-ms",
        type=float,
        default=ServeOptions.step_budget_ms,
        help=f"the server's --step-budget-ms (default {ServeOptions.step_budget_ms:g}; 0: none, to compare)",
    )
    ap.add_argument("--synthetic-step", default="", metavar="COST",
                    help="how long the synthetic generator's step lasts: FIXED+ROW ms for a step of N streams "
                    "(FIXED + N x ROW), or a GPU-like preset (h100, l4): engine/step_cost.py "
                    "(default: free math, a burst rather than live streams)")  # fmt: skip
    ap.add_argument("--tts-instances", type=int, default=1, help="the server's --tts-instances: tts's stub "
                    "processes (default 1)")  # fmt: skip
    ap.add_argument("--first-audio-rule", action="store_true",
                    help="open loop: a rate passes only if first audio p95 is also within 4 generator steps (the "
                    "rate's mean step) + 200 ms, the headline's rule (docs/benchmarks.md)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write every level's numbers here")
    args = ap.parse_args(argv)
    from engine.step_cost import StepCost

    try:
        args.step_cost = StepCost.parse(args.synthetic_step)
    except ValueError as e:
        ap.error(f"--synthetic-step: {e}")
    if args.real and args.synthetic_step:
        ap.error("--synthetic-step times the synthetic generator; --real runs the networks")
    if args.start_rate < 0 or args.step_budget_ms < 0:
        ap.error("need --start-rate >= 0 (0: no window) and --step-budget-ms >= 0 (0: none)")
    if not 1 <= args.start <= args.slots <= MAX_SLOTS:
        ap.error(f"need 1 <= --start <= --slots <= {MAX_SLOTS}")
    if args.rate_start is not None and not 0 < args.rate_start <= args.rate_max:
        ap.error("need 0 < --rate-start <= --rate-max")
    if args.duration <= 0 or args.drain_timeout < 0:
        ap.error("need --duration > 0 and --drain-timeout >= 0 seconds")
    if args.first_audio_rule and args.rate_start is None:
        ap.error("--first-audio-rule judges open-loop rates: give --rate-start")
    return args


class BenchError(Exception):
    """The run cannot go on (a server's warm-up stream failed): said on stderr, exit status 1."""


def main(argv: list[str] | None = None) -> int:
    from bench.server import local_server

    args = parse_args(argv)
    params = {"max_patches": args.patches, **chunk_parameters(args)}
    open_loop = args.rate_start is not None
    level, unit = ("rate", "requests/s") if open_loop else ("concurrency", "streams")
    request = {"parameters": params}
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    status = 0  # 1: a server's warm-up stream failed
    # the server of the levels since the last failed one, its load client, and the stack that stops both
    stack, server, client = contextlib.ExitStack(), None, None

    def start_server() -> None:
        """A new server (and load client) for the next levels, checked by a warm-up stream (BenchError if not)."""
        nonlocal stack, server, client
        stack.close()
        stack = contextlib.ExitStack()
        server = stack.enter_context(local_server(args.preset, args.slots, args.device, synthetic_math=not args.real,
                                                  max_len=max(256, args.patches + 192),
                                                  start_rate=args.start_rate, step_budget_ms=args.step_budget_ms,
                                                  synthetic_step=args.synthetic_step,
                                                  tts_instances=args.tts_instances))  # fmt: skip
        url = f"127.0.0.1:{server.ports.grpc}"
        client = TTSClient(url, timeout=args.timeout)
        warm = one_stream(client, TEXTS[0], seed=0, request=request)
        if warm.error:
            raise BenchError(f"the warm-up stream failed: {warm.error}")
        expected = args.patches * 0.16
        if abs(warm.audio - expected) > 1e-6:
            raise BenchError(f"the warm-up stream gave {warm.audio:.3f} s of audio, not {expected:.3f}")
        if args.client == "aio":
            client = stack.enter_context(LoadProcess(url, args.timeout))

    try:
        start_server()

        def passed(n) -> bool:
            # after a failed level, a new server: its overload must not carry over (the start window backed off
            # there, and its growth stays capped for engine.start_window.CEILING_SECONDS, longer than a level)
            if rows and not rows[-1]["passed"]:
                print(f"  {n:g} {unit}: on a new server (the last level failed)", file=sys.stderr, flush=True)
                start_server()
            print(f"  {n:g} {unit}: starting", file=sys.stderr, flush=True)
            row = measure_rate(server, client, n, args, request) if open_loop else measure(server, client, n, request)
            rows.append(row)
            verdict = "pass" if row["passed"] else "FAIL"
            if "first_audio_limit_ms" in row:
                p95, limit = row["first_chunk_ms"]["p95"], row["first_audio_limit_ms"]
                verdict += f" (first audio p95 {p95:.0f} ms, limit {limit:.0f})"
            print(f"  {n:g} {unit}: {verdict}, {row['underruns']} underruns, {row['errors']} errors, worst gap "
                  f"{row['worst_gap_ms']:.0f} ms, generator step {row['generator_step_ms']:.1f} ms "
                  f"(batch {row['mean_batch']:.1f}), CPU {row['cpu_ms_per_stream_step_all']:.2f} ms per stream-step; "
                  f"load {row['load_average']:.1f}", file=sys.stderr, flush=True)  # fmt: skip
            if row["first_error"]:
                print(f"    first error: {row['first_error']}", file=sys.stderr, flush=True)
            return row["passed"]

        if open_loop:
            levels_to_run(args.rate_start, args.rate_max, args.bisect, passed, rate_midpoint)
        else:
            levels_to_run(args.start, args.slots, args.bisect, passed)
    except BenchError as e:  # the levels that ran are still reported below
        print(f"error: {e}", file=sys.stderr)
        status = 1
    finally:
        stack.close()
    if not rows:
        return status

    good = [r[level] for r in rows if r["passed"]]
    ceiling = max(good, default=0)
    if open_loop:
        top = "" if any(not r["passed"] for r in rows) else f" (every level passed: at least {ceiling:g}, --rate-max)"
        peak = max((r["peak_streams"] for r in rows if r["passed"]), default=0)
        rule = " and first audio p95 within 4 steps + 200 ms" if args.first_audio_rule else ""
        print(f"ceiling: {ceiling:g} requests/s of Poisson arrivals with no underrun and no failure{rule}{top}, up to "
              f"{peak} streams at once; {args.duration:g} s of arrivals per rate, seed {args.seed}")  # fmt: skip
    else:
        top = "" if any(not r["passed"] for r in rows) else f" (every level passed: at least {ceiling}, the slot limit)"
        print(f"ceiling: {ceiling} concurrent real-time streams with no underrun{top}")
    print(
        (
            f"real math, {args.preset} preset on {args.device}"
            if args.real
            else f"synthetic math (step {args.step_cost}), {args.preset} prompt encoder"
        )
        + f", {args.slots} slots, {args.patches} patches per stream, "
        f"start rate {f'{args.start_rate:g}/s' if args.start_rate else 'no window'}, "
        f"step budget {f'{args.step_budget_ms:g} ms' if args.step_budget_ms else 'none'}, "
        f"{args.tts_instances} tts instance{'s' if args.tts_instances > 1 else ''}, "
        f"request parameters {params}; {platform.node()} ({os.cpu_count()} CPUs, {args.client} client on the same "
        "machine), "
        f"1-min load average {load_before:.1f} before, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print()
    print(table(rows, level))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        raw = {"ceiling": ceiling, "unit": unit, "patches": args.patches, "parameters": params, "slots": args.slots,
               "preset": args.preset, "levels": rows, "cpus": os.cpu_count(), "load_before": load_before,
               "start_rate": args.start_rate, "step_budget_ms": args.step_budget_ms,
               "tts_instances": args.tts_instances, "first_audio_rule": args.first_audio_rule,
               "synthetic_step": str(args.step_cost), "real": args.real, "device": args.device}  # fmt: skip
        args.json.write_text(json.dumps(raw, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
