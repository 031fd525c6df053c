"""``python -m bench`` (or ``make bench ARGS=...``): streaming latency and throughput against concurrency, or
against an arrival rate.

Against a running server (``--url``) or, by default, one it starts for ``--preset`` (see
:mod:`bench.server`). Closed loop (the default): for each concurrency it streams ``--requests``
utterances with that many in flight. Open loop (``--rate 0.5,1,2``): for each rate, requests arrive on a
seeded Poisson schedule for ``--duration`` s whether or not earlier ones have finished, each speaking a
text of a mixed set (:mod:`bench.openloop`). Either way it prints a markdown table; the table (.md), raw
numbers (.json) and a plot (.png) go to ``results/bench/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.load import console_progress, one_stream, run_level
from bench.openloop import (
    CONTINUITY_GAP_S,
    MIXED_TEXTS,
    add_open_loop_options,
    parse_rates,
    poisson_arrivals,
    run_rate,
)
from bench.report import markdown, open_loop_markdown, open_loop_plot, plot
from bench.request_options import add_chunk_options, chunk_parameters
from client import TTSClient
from serving.supervision.triton_env import REPO_ROOT

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech synthesis sends audio while the sentence is still being generated.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Please hold the line, your call is important to us.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server's HOST:PORT for --protocol (default: start one)")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--preset", choices=["tiny", "small"], default="tiny", help="checkpoint of the started server")
    ap.add_argument("--slots", type=int, default=8, help="generator slots of the started server (default 8)")
    ap.add_argument("--device", default="cpu", help="device of the started server's models (cpu, cuda)")
    ap.add_argument("--concurrency", help="comma-separated stream counts (closed loop; default 1,2,4,8,16)")
    ap.add_argument("--requests", type=int, help="streams per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--rate", help="comma-separated arrival rates, requests/s: open loop instead of --concurrency")
    add_open_loop_options(ap)
    ap.add_argument("--max-patches", type=int, default=24,
                    help="length limit per text segment, 160 ms patches (default 24)")  # fmt: skip
    add_chunk_options(ap)
    ap.add_argument("--text", action="append",
                    help="text to speak (repeatable; default: built-in sentences, or with --rate a mixed set of "
                    "English and Chinese replies and paragraphs)")  # fmt: skip
    ap.add_argument(
        "--instruction",
        help="FireRedTTS3-Instruct voice design with this description (default: Base); "
        "its plan text comes before the first audio, so first-chunk latency includes it",
    )
    ap.add_argument("--synthetic-step", metavar="COST",
                    help="serve the started server with synthetic math whose generator step lasts COST: FIXED+ROW "
                    "ms or a preset (h100, l4); engine/step_cost.py (default: the real model)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response")
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "results" / "bench")
    ap.add_argument(
        "--name",
        help="file stem of the outputs (default: PRESET-PROTOCOL, or server-PROTOCOL; -open-loop appended with --rate)",
    )
    args = ap.parse_args(argv)
    args.rates = None
    if args.synthetic_step is not None:
        from engine.step_cost import StepCost

        if args.url:
            ap.error("--synthetic-step sets up the started server; a running one (--url) has its own")
        try:
            args.step_cost = StepCost.parse(args.synthetic_step)
        except ValueError as e:
            ap.error(f"--synthetic-step: {e}")
    if args.rate is not None:
        if args.concurrency is not None or args.requests is not None:
            ap.error("--rate (open loop) takes neither --concurrency nor --requests")
        try:
            args.rates = parse_rates(args.rate)
        except ValueError as e:
            ap.error(f"--rate: {e}")
        if args.duration <= 0 or args.drain_timeout < 0:
            ap.error("need --duration > 0 and --drain-timeout >= 0 seconds")
        return args
    args.concurrency = args.concurrency or "1,2,4,8,16"
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency needs stream counts >= 1")
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be >= 1")
    return args


def closed_loop(args: argparse.Namespace, client: TTSClient, texts: list[str], request: dict) -> list:
    """One :class:`bench.load.LevelResult` per ``--concurrency`` level."""
    levels = []
    for c in args.levels:
        n = args.requests or max(8, 2 * c)
        level = run_level(client, c, n, texts, request, progress=console_progress(c))
        levels.append(level)
        s = level.summary()
        line = f"first chunk p50 {s['first_chunk_ms']['p50']:.0f} ms, {s['audio_s_per_wall_s']:.2f} audio s / wall s"
        print(f"  concurrency {c:>3}: {line}, {s['errors']} errors", file=sys.stderr, flush=True)
    return levels


def open_loop(args: argparse.Namespace, client: TTSClient, texts: list[str], request: dict) -> list:
    """One :class:`bench.openloop.RateLevelResult` per ``--rate``, each on the same seeded schedule."""
    levels = []
    for rate in args.rates:
        arrivals = poisson_arrivals(rate, args.duration, args.seed, tuple(texts))
        label = f"rate {rate:g}/s"
        level = run_rate(client, arrivals, rate, args.duration, request, args.drain_timeout, console_progress(label))
        levels.append(level)
        s = level.summary()
        print(f"  {label}: {s['complete']}/{s['requests']} complete, {s['achieved_rps']:.2f} req/s, first audio p50 "
              f"{s['first_chunk_ms']['p50']:.0f} ms, {s['underruns']} underruns, continuity OK "
              f"{s['continuity_ok_rate']:.0%}", file=sys.stderr, flush=True)  # fmt: skip
    return levels


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    is_open_loop = args.rates is not None
    mode = "-open-loop" if is_open_loop else ""
    name = args.name or f"{'server' if args.url else args.preset}-{args.protocol}{mode}"
    request = {"parameters": {"max_patches": args.max_patches, **chunk_parameters(args)}}
    if args.instruction:
        request["instruction"] = args.instruction
    texts = args.text or (list(MIXED_TEXTS) if is_open_loop else TEXTS)

    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        if args.url:
            url, target = args.url, f"server at {args.url}"
        else:
            from bench.server import local_server

            synthetic = {} if args.synthetic_step is None else {"synthetic_math": True,
                                                                 "synthetic_step": args.synthetic_step}  # fmt: skip
            server = stack.enter_context(local_server(args.preset, args.slots, args.device, **synthetic))
            port = server.ports.grpc if args.protocol == "grpc" else server.ports.http
            synth = "" if args.synthetic_step is None else f", synthetic math with a {args.step_cost} step"
            url, target = (
                f"127.0.0.1:{port}",
                f"{args.preset} checkpoint (stop head off), {args.slots} slots, {args.device}{synth}",
            )
        client = TTSClient(url, args.protocol, timeout=args.timeout)
        warm = one_stream(client, texts[0], seed=0, request=request)  # first-use costs stay out of the table
        if warm.error:
            print(f"error: the warm-up stream failed: {warm.error}", file=sys.stderr)
            return 1
        print(f"warm-up stream: {warm.audio:.2f} s of audio in {warm.total:.2f} s", file=sys.stderr, flush=True)
        levels = (open_loop if is_open_loop else closed_loop)(args, client, texts, request)

    rows = [lv.summary() for lv in levels]
    title = f"{name}: {target}, {args.protocol}"
    machine = (
        f"client and server on {platform.node()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d %H:%M')}; "
        f"1-min load average before the run {load_before:.1f} (other busy processes skew every number)"
    )
    underrun = (
        "underrun: a listener playing each stream from its first chunk on (that chunk the only buffer) would "
        "hear it stall at least once; worst gap = the longest such stall"
    )
    if is_open_loop:
        notes = open_loop_notes(args, request, len(texts), rows) + [machine, underrun]
        table = open_loop_markdown(rows, title, notes)
    else:
        notes = [
            (
                f"max_patches {args.max_patches} ({args.max_patches * 0.16:.2f} s of audio per stream at most), "
                f"requests per level {args.requests or 'max(8, 2 x streams)'}, parameters {request['parameters']}"
            ),
            machine,
            (
                "RTF = a stream's wall time / its audio time (< 1 is faster than real time); "
                "audio s / wall s = all streams' audio over the level's wall time"
            ),
            underrun,
        ]
        table = markdown(rows, title, notes)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / name
    stem.with_suffix(".md").write_text(table)
    raw = {"name": name, "target": target, "protocol": args.protocol, "request": request, "notes": notes,
           "synthetic_step": args.synthetic_step, "levels": [lv.to_json() for lv in levels]}  # fmt: skip
    if is_open_loop:
        raw |= {"mode": "open-loop", "rates": args.rates, "duration_s": args.duration, "seed": args.seed,
                "drain_timeout_s": args.drain_timeout, "texts": texts}  # fmt: skip
        open_loop_plot(rows, title, stem.with_suffix(".png"))
    else:
        plot(rows, title, stem.with_suffix(".png"), slots=None if args.url else args.slots)
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(table)
    print(f"wrote {stem}.md, .json and .png", file=sys.stderr)
    return 0


def open_loop_notes(args: argparse.Namespace, request: dict, n_texts: int, rows: list[dict]) -> list[str]:
    lag = max((r["start_lag_ms_max"] for r in rows), default=0.0)
    texts = "the built-in mix of English and Chinese replies and paragraphs" if not args.text else "--text"
    return [
        (
            f"Poisson arrivals for {args.duration:g} s per rate (seed {args.seed}), each a text drawn from "
            f"{n_texts} ({texts}); then up to {args.drain_timeout:g} s for the streams in flight (the rest count "
            f"as timeouts); max_patches {args.max_patches} per text segment, parameters {request['parameters']}"
        ),
        (
            "achieved req/s = complete streams / the run's seconds (--duration, or until the last stream ended "
            "if later: below the target by that tail on short runs); first audio from sending the request; "
            "RTF = a stream's wall time / its audio time"
        ),
        (
            f"continuity OK = share of complete streams with no stall over {1000 * CONTINUITY_GAP_S:.0f} ms; "
            "failures: busy (refused or ended `unavailable:`: queue full, restarting, shutting down), invalid, "
            "unavailable (no server answered, or the connection broke), error (the server failed), timeout"
        ),
        f"every stream was sent within {lag:.0f} ms of its scheduled time (more would mean a client falling behind)",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
