"""``python -m bench.mixed``: short requests arriving open-loop while a long text is spoken with read-ahead,
against the same arrivals alone: does the long text change what the short requests' listeners hear?

On a server this starts (:mod:`bench.server`: the no-stop checkpoint, so every segment is ``--patches``
long; synthetic math with ``--synthetic-step``, else the real tiny model), short requests arrive on a seeded
Poisson schedule (:mod:`bench.openloop`) for ``--duration`` s, twice: alone, then beside long requests (a
text of ``--sentences`` sentences, ``read_ahead`` ``--read-ahead``), one after another for the whole run. The
fairness rule (docs/serving.md, "Long-form text: read-ahead") says a waiting start goes before any
read-ahead segment, so the short requests' first audio should not move. With ``--job`` the long text is a
job of the gateway's job API instead (docs/longform.md: one part a sentence, ``--read-ahead`` parts at once). Prints one row per run: the short
requests' first chunk p50 / p90 / p99, underruns and errors, and the long requests' audio per wall second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.load import one_stream
from bench.openloop import MIXED_TEXTS, poisson_arrivals, run_rate
from client import TTSClient

SHORT_TEXTS = tuple(t for t in MIXED_TEXTS if len(t) < 80)  # one segment each
SENTENCE = "Sentence number {i} of the long text is here."


def long_requests(client: TTSClient, text: str, request: dict, stop: threading.Event, out: list) -> None:
    """Speak ``text`` again and again until ``stop``; append (wall s, audio s, error) per request."""
    while not stop.is_set():
        r = one_stream(client, text, seed=7, request=request, cancel=stop)
        if r.failure == "timeout" and stop.is_set():
            return  # cut by the end of the run, not a failure
        out.append((r.total, r.audio, r.error))


def long_jobs(url: str, text: str, fields: dict, stop: threading.Event, out: list) -> None:
    """Run ``text`` as a job again and again until ``stop`` (the running one is cancelled then); append
    (wall s, audio s, error) per finished job."""
    import httpx

    while not stop.is_set():
        t0 = time.perf_counter()
        job = httpx.post(f"{url}/v1/audio/jobs", json={"input": text, **fields}, timeout=60).json()
        if "id" not in job:
            out.append((0.0, 0.0, str(job)))
            return
        while job["status"] in ("queued", "running") and not stop.is_set():
            time.sleep(0.1)
            job = httpx.get(f"{url}/v1/audio/jobs/{job['id']}", timeout=60).json()
        if stop.is_set() and job["status"] in ("queued", "running"):
            httpx.post(f"{url}/v1/audio/jobs/{job['id']}/cancel", timeout=60)
            return
        out.append((time.perf_counter() - t0, job.get("audio_seconds") or 0.0,
                    None if job["status"] == "done" else f"{job['status']}: {job.get('error')}"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mixed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0, help="short requests a second (default 4)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run (default 30)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival schedule (default 0)")
    ap.add_argument("--patches", type=int, default=12, help="each segment's length, 160 ms patches (default 12)")
    ap.add_argument("--sentences", type=int, default=40, help="the long text's sentences (default 40)")
    ap.add_argument("--read-ahead", type=int, default=4, help="the long requests' read_ahead (default 4)")
    ap.add_argument("--job", action="store_true", help="the long text as a job of the gateway's job API")
    ap.add_argument("--synthetic-step", default="", metavar="COST",
                    help="synthetic math with this step (engine/step_cost.py: FIXED+ROW ms, h100, l4); "
                    "default: the real tiny model")  # fmt: skip
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or not 1 <= args.read_ahead <= 16 or args.sentences < 1:
        ap.error("need --rate > 0, --duration > 0, 1 <= --read-ahead <= 16, --sentences >= 1")

    from bench.server import local_server

    synthetic = {"synthetic_math": True, "synthetic_step": args.synthetic_step} if args.synthetic_step else {}
    params = {"max_patches": args.patches, "chunk_first": 1, "chunk_next": 4}
    short = {"parameters": params}
    long = {"parameters": {**params, "read_ahead": args.read_ahead}}
    text = " ".join(SENTENCE.format(i=i) for i in range(args.sentences))
    arrivals = poisson_arrivals(args.rate, args.duration, args.seed, SHORT_TEXTS)
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(local_server(args.preset, args.slots, read_ahead_cap=16, **synthetic))
        client = TTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=120)
        if args.job:
            from gateway.jobs.options import JobOptions
            from gateway.server import in_thread

            folder = stack.enter_context(tempfile.TemporaryDirectory())
            jobs = JobOptions(Path(folder), part_chars=60, parts_at_once=args.read_ahead, running=1)
            url = stack.enter_context(in_thread(f"127.0.0.1:{server.ports.grpc}", jobs=jobs))
            fields = {"response_format": "wav", "seed": 7, **params}
            runner_of = lambda done, stop: (long_jobs, (url, text, fields, stop, done))  # noqa: E731
        else:
            runner_of = lambda done, stop: (long_requests, (client, text, long, stop, done))  # noqa: E731
        warm = one_stream(client, SHORT_TEXTS[0], seed=0, request=short)
        if warm.error:
            print(f"error: the warm-up stream failed: {warm.error}", file=sys.stderr)
            return 1
        for beside in (False, True):
            stop, done = threading.Event(), []
            target, targs = runner_of(done, stop)
            runner = threading.Thread(target=target, args=targs, daemon=True)
            if beside:
                runner.start()
                time.sleep(1.0)  # the long text is under way before the first short request
            print(f"  {'beside a long text' if beside else 'alone'}: {len(arrivals)} short requests over "
                  f"{args.duration:g} s", file=sys.stderr, flush=True)  # fmt: skip
            level = run_rate(client, arrivals, args.rate, args.duration, short)
            stop.set()
            if beside:
                runner.join()
            s = level.summary()
            audio = sum(a for _, a, e in done if e is None)
            wall = sum(w for w, _, e in done if e is None)
            rows.append((
                "beside a long text" if beside else "alone", s["requests"], s["errors"], s["underruns"],
                *(s["first_chunk_ms"][f"p{q}"] for q in (50, 90, 99)),
                f"{len(done)} ({sum(e is not None for _, _, e in done)} failed)" if beside else "-",
                f"{audio / wall:.2f}" if beside and wall else "-",
            ))  # fmt: skip
    step = f"synthetic math, step {args.synthetic_step}" if args.synthetic_step else f"the real {args.preset} model"
    print(f"\n{step}, {args.slots} slots, short requests {args.rate:g}/s for {args.duration:g} s (seed {args.seed}), "
          f"segments of {args.patches} patches, long text {args.sentences} sentences "
          f"{'as a job, parts at once' if args.job else 'with read_ahead'} {args.read_ahead}; load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| run | short requests | errors | underruns | first chunk p50 / p90 / p99 ms | long requests done "
          "| long: audio s per wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} / {r[5]:.0f} / {r[6]:.0f} | {r[7]} | {r[8]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
