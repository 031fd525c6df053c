"""``python -m bench.jobs``: a long text through the gateway's job API (docs/longform.md) with 1 part at a
time and with more, on a server this starts (:mod:`bench.server`: a no-stop checkpoint, so every part is
exactly ``--max-patches`` long). Prints, per ``--parts-at-once``, the wall time from submit to done, the
audio made, audio seconds per wall second, and whether the file's bytes equal the first run's (parts are
independent requests with the job's seed: in the server's batch-invariant mode (on by default on CPU), the bytes are
equal however many run at once; with ``--no-batch-invariant`` parts run beside each other are float-close:
docs/serving.md#what-a-seed-guarantees), with the largest sample difference and the SNR when they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

SENTENCE = "Sentence number {i} is short."  # one part each with --part-chars 30


def run_job(url: str, text: str, fields: dict) -> tuple[float, bytes, dict]:
    """Submit, wait for done -> (wall seconds, the file, the job object)."""
    t0 = time.perf_counter()
    job = httpx.post(f"{url}/v1/audio/jobs", json={"input": text, **fields}, timeout=60).json()
    if "id" not in job:
        raise SystemExit(f"refused: {job}")
    while job["status"] in ("queued", "running"):
        time.sleep(0.05)
        job = httpx.get(f"{url}/v1/audio/jobs/{job['id']}", timeout=60).json()
    wall = time.perf_counter() - t0
    if job["status"] != "done":
        raise SystemExit(f"the job ended {job['status']}: {job.get('error')}")
    return wall, httpx.get(f"{url}/v1/audio/jobs/{job['id']}/audio", timeout=60).content, job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.jobs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--parts", type=int, default=40, help="sentences, one part each")
    ap.add_argument("--max-patches", type=int, default=12, help="each part's length (the checkpoint never stops)")
    ap.add_argument("--parts-at-once", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's batch-invariant mode (engine/invariant.py)")  # fmt: skip
    args = ap.parse_args(argv)

    from bench.server import local_server
    from gateway.jobs.options import JobOptions
    from gateway.server import in_thread

    text = " ".join(SENTENCE.format(i=i) for i in range(args.parts))
    fields = {"response_format": "wav", "seed": 7, "max_patches": args.max_patches, "chunk_first": 1,
              "chunk_next": 2, "chunk_fixed": True}  # fmt: skip
    rows, first = [], None
    with local_server(args.preset, args.slots, batch_invariant="on" if args.batch_invariant else "off") as server:
        for k in args.parts_at_once:
            with tempfile.TemporaryDirectory() as folder:
                jobs = JobOptions(Path(folder), part_chars=30, parts_at_once=k, running=1)
                with in_thread(f"127.0.0.1:{server.ports.grpc}", jobs=jobs) as url:
                    wall, wav, job = run_job(url, text, fields)
            samples = np.frombuffer(wav[44:], "<i2").astype(np.float64)
            if first is None:
                first = samples
            same = "yes" if np.array_equal(samples, first) else "no"
            diff = np.abs(samples - first).max() if samples.size == first.size else float("nan")
            snr = (10 * np.log10(np.sum(first**2) / np.sum((samples - first) ** 2))
                   if samples.size == first.size and same == "no" else float("inf"))  # fmt: skip
            rows.append((k, job["parts_total"], wall, job["audio_seconds"], job["audio_seconds"] / wall, same, diff,
                         snr, hashlib.sha256(wav).hexdigest()[:12]))  # fmt: skip
    mode = "batch-invariant" if args.batch_invariant else "not batch-invariant"
    print(f"\n{args.parts} parts of {args.max_patches} patches, preset {args.preset}, {args.slots} slots ({mode}), "
          "one job at a time, WAV", file=sys.stderr)  # fmt: skip
    print("| parts at once | parts | wall s | audio s | audio s / wall s | bytes = first run | max diff (16-bit steps) "
          "| SNR vs first (dB) | sha256 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for k, parts, wall, audio, speed, same, diff, snr, digest in rows:
        print(
            f"| {k} | {parts} | {wall:.1f} | {audio:.1f} | {speed:.2f} | {same} | {diff:.0f} | {snr:.1f} | {digest} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
