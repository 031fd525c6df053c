"""``python -m bench`` (or ``make bench ARGS=...``): streaming latency and throughput against concurrency.

Against a running server (``--url``) or, by default, one it starts for ``--preset`` (see
:mod:`bench.server`). For each concurrency it streams ``--requests`` utterances with that many in flight
and prints a markdown table; the table (.md), raw numbers (.json) and a plot (.png) go to
``results/bench/``.
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
from bench.report import markdown, plot
from client import TTSClient
from serving.triton_env import REPO_ROOT

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
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated stream counts")
    ap.add_argument("--requests", type=int, help="streams per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--max-patches", type=int, default=24, help="utterance length limit, 160 ms patches (default 24)")
    ap.add_argument("--chunk-first", type=int, help="request parameter (server default when omitted)")
    ap.add_argument("--chunk-next", type=int, help="request parameter (server default when omitted)")
    ap.add_argument("--chunk-fixed", action="store_true", default=None,
                    help="request parameter: the fixed schedule (chunk_first, then chunk_next each) instead of "
                    "the deadline rule")  # fmt: skip
    ap.add_argument("--text", action="append", help="text to speak (repeatable; default: built-in sentences)")
    ap.add_argument("--instruction", help="FireRedTTS3-Instruct voice design with this description (default: Base); "
                    "its plan text comes before the first audio, so first-chunk latency includes it")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response")
    ap.add_argument("--out-dir", type=Path, default=REPO_ROOT / "results" / "bench")
    ap.add_argument("--name", help="file stem of the outputs (default: PRESET-PROTOCOL, or server-PROTOCOL)")
    args = ap.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency needs stream counts >= 1")
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.name or f"{'server' if args.url else args.preset}-{args.protocol}"
    request = {"parameters": {"max_patches": args.max_patches}}
    if args.instruction:
        request["instruction"] = args.instruction
    for key in ("chunk_first", "chunk_next", "chunk_fixed"):
        if getattr(args, key) is not None:
            request["parameters"][key] = getattr(args, key)
    texts = args.text or TEXTS

    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        if args.url:
            url, target = args.url, f"server at {args.url}"
        else:
            from bench.server import local_server

            server = stack.enter_context(local_server(args.preset, args.slots, args.device))
            port = server.ports.grpc if args.protocol == "grpc" else server.ports.http
            url, target = f"127.0.0.1:{port}", f"{args.preset} checkpoint (stop head off), {args.slots} slots, {args.device}"
        client = TTSClient(url, args.protocol, timeout=args.timeout)
        warm = one_stream(client, texts[0], seed=0, request=request)  # first-use costs stay out of the table
        if warm.error:
            print(f"error: the warm-up stream failed: {warm.error}", file=sys.stderr)
            return 1
        print(f"warm-up stream: {warm.audio:.2f} s of audio in {warm.total:.2f} s", file=sys.stderr, flush=True)
        levels = []
        for c in args.levels:
            n = args.requests or max(8, 2 * c)
            level = run_level(client, c, n, texts, request, progress=console_progress(c))
            levels.append(level)
            s = level.summary()
            line = (
                f"first chunk p50 {s['first_chunk_ms']['p50']:.0f} ms, {s['audio_s_per_wall_s']:.2f} audio s / wall s"
            )
            print(f"  concurrency {c:>3}: {line}, {s['errors']} errors", file=sys.stderr, flush=True)

    rows = [lv.summary() for lv in levels]
    title = f"{name}: {target}, {args.protocol}"
    notes = [
        (
            f"max_patches {args.max_patches} ({args.max_patches * 0.16:.2f} s of audio per stream at most), "
            f"requests per level {args.requests or 'max(8, 2 x streams)'}, parameters {request['parameters']}"
        ),
        (
            f"client and server on {platform.node()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d %H:%M')}; "
            f"1-min load average before the run {load_before:.1f} (other busy processes skew every number)"
        ),
        (
            "RTF = a stream's wall time / its audio time (< 1 is faster than real time); "
            "audio s / wall s = all streams' audio over the level's wall time"
        ),
        (
            "underrun: a listener playing each stream from its first chunk on (that chunk the only buffer) would "
            "hear it stall at least once; worst gap = the longest such stall"
        ),
    ]
    table = markdown(rows, title, notes)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / name
    stem.with_suffix(".md").write_text(table)
    raw = {"name": name, "target": target, "protocol": args.protocol, "request": request, "notes": notes,
           "levels": [lv.to_json() for lv in levels]}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    plot(rows, title, stem.with_suffix(".png"), slots=None if args.url else args.slots)
    print(table)
    print(f"wrote {stem}.md, .json and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
