"""CPU cost of ``speed`` (engine.time_stretch), per stream, fed as the server feeds it.

    python bench/time_stretch.py [--seconds 20] [--repeats 3]

Streams a voiced test signal (a gliding harmonic tone with noise) through the stretcher in the default
chunk schedule's chunk sizes and prints, per speed, the best wall time of ``--repeats`` runs, the
real-time factor against the output's duration, and the longest single ``push`` (what one chunk holds a
thread for).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import PATCH_SAMPLES  # noqa: E402
from engine.params import DEFAULT_SCHEDULE  # noqa: E402
from engine.protocol import SAMPLE_RATE  # noqa: E402
from engine.time_stretch import TimeStretch  # noqa: E402

SPEEDS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def voiced(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 140 * (1 + 0.15 * np.sin(2 * np.pi * 0.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    x = sum(np.sin(h * phase) / h for h in range(1, 10)) * 0.15 * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    return (x + 0.01 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)


def run(x: np.ndarray, speed: float) -> tuple[float, float, int]:
    """(wall seconds, longest push in seconds, output samples) for one stream."""
    sizes = [n * PATCH_SAMPLES for n in (DEFAULT_SCHEDULE.first, DEFAULT_SCHEDULE.cap)]
    ts, i, longest, out = TimeStretch(speed), 0, 0.0, 0
    t0 = time.perf_counter()
    while i < x.size:
        n = sizes[0] if i == 0 else sizes[-1]
        t = time.perf_counter()
        out += ts.push(x[i : i + n]).size
        longest = max(longest, time.perf_counter() - t)
        i += n
    out += ts.finish().size
    return time.perf_counter() - t0, longest, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/time_stretch.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="input audio per stream (default 20)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per speed; the best is shown (default 3)")
    args = ap.parse_args(argv)
    x = voiced(args.seconds)
    print(f"{args.seconds:g} s of input in chunks of {[DEFAULT_SCHEDULE.first, DEFAULT_SCHEDULE.cap]} patches\n")
    print("| speed | output s | wall ms | real-time factor | longest push ms |")
    print("|---|---|---|---|---|")
    for speed in SPEEDS:
        wall, longest, out = min(run(x, speed) for _ in range(args.repeats))
        seconds = out / SAMPLE_RATE
        print(f"| {speed:g} | {seconds:.1f} | {wall * 1e3:.1f} | {wall / seconds:.4f} | {longest * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
