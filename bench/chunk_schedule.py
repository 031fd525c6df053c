"""Chunk schedules as a listener hears them: a simulation over step times, no model, no server.

    python bench/chunk_schedule.py [--patches 200] [--streams 200] [--jitter 0.2] [--floor 0.05]

One stream makes a patch (160 ms of audio) per step; a step takes ``r`` x 160 ms times a seeded jitter,
the first step (prefill) twice that. After each step the schedule says whether the gathered patches
become a chunk (engine.chunking.ChunkClock; ``fixed``: the schedule before issue 26). A chunk reaches the
listener after the next step (the generator sends a step's chunks with the stream's next request) and
``--floor`` seconds (vocoder, transport). The listener plays from the first chunk's arrival and stalls
whenever the next chunk is late. Printed per schedule and r: streams that stalled, the worst gap, the
stall time per stream, chunks per stream (each a vocoder call and ~2 ms of the front door's CPU), and
the largest chunk. ``--segments N`` splits each stream in N text segments, each started after the
previous one's last chunk arrives (tts runs segments one after another), with what the listener holds
then passed on (``buffered``) or not; ``--prefill`` is a segment's first step (its prefill, and any wait
for a slot) in steps.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.chunking import PATCH_SECONDS, ChunkClock, ChunkSchedule  # noqa: E402

RATIOS = (0.3, 0.5, 0.65, 0.8, 0.9, 0.95, 1.1, 1.5)


def segment_chunks(schedule: ChunkSchedule, patches: int, r: float, start: float, rng, args):
    """One text segment's chunks as (arrival time, patches), and the time its last step ended."""
    steps = r * PATCH_SECONDS * (1 + args.jitter * rng.uniform(-1, 1, patches + 1))
    steps[0] *= args.prefill
    floor = args.floor
    clock, now, pending, out = ChunkClock(schedule, start), start, 0, []
    for i in range(patches):
        now += steps[i]
        pending += 1
        if clock.due(pending, now) or i == patches - 1:
            out.append((now + steps[i + 1] + floor, pending))
            pending = 0
    return out, now


def listen(chunks: list[tuple[float, int]]) -> list[float]:
    """Stall gaps (seconds) of a listener who plays from the first chunk's arrival."""
    gaps, end = [], None
    for arrival, patches in sorted(chunks):
        if end is not None and arrival > end + 1e-9:
            gaps.append(arrival - end)
        end = (arrival if end is None else max(end, arrival)) + patches * PATCH_SECONDS
    return gaps


def utterance(schedule: ChunkSchedule, patches: int, r: float, rng, args, how: str) -> list[tuple[float, int]]:
    """The chunks of ``args.segments`` segments run one after another."""
    chunks, now, per = [], 0.0, patches // args.segments
    for k in range(args.segments):
        first = schedule
        if k > 0 and how == "steady":  # before issue 26: later segments at the steady size throughout
            first = ChunkSchedule(schedule.cap, schedule.cap, True)
        elif k > 0 and how == "buffered":
            gaps = listen(chunks)
            held = chunks[0][0] + sum(p for _, p in chunks) * PATCH_SECONDS + sum(gaps) - now
            first = replace(schedule, buffered=max(0.0, held - args.floor))
        seg, _ = segment_chunks(first, per, r, now, rng, args)
        chunks += seg
        now = seg[-1][0]  # tts starts the next segment once this one's last chunk is through the vocoder
    return chunks


def row(label: str, schedule: ChunkSchedule, r: float, args, how: str = "buffered") -> str:
    rng = np.random.default_rng(args.seed)
    stalled, worst, stall_time, counts, largest = 0, 0.0, 0.0, 0, 0
    for _ in range(args.streams):
        chunks = utterance(schedule, args.patches, r, rng, args, how)
        gaps = listen(chunks)
        stalled += bool(gaps)
        worst = max([worst, *gaps])
        stall_time += sum(gaps)
        counts += len(chunks)
        largest = max(largest, *(p for _, p in chunks))
    n = args.streams
    return (f"| {label} | {r:g} | {stalled}/{n} | {worst * 1000:,.0f} | {stall_time / n * 1000:,.0f} "
            f"| {counts / n:.1f} | {largest} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patches", type=int, default=200, help="patches per utterance (200 = 32 s)")
    ap.add_argument("--streams", type=int, default=200, help="simulated streams per row")
    ap.add_argument("--jitter", type=float, default=0.2, help="each step is r x 160 ms x (1 +- jitter)")
    ap.add_argument("--floor", type=float, default=0.05, help="vocoder and transport per chunk, seconds")
    ap.add_argument("--segments", type=int, default=1, help="text segments per utterance")
    ap.add_argument("--prefill", type=float, default=2.0, help="a segment's first step, in steps (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", type=float, nargs="+", default=RATIOS, help="step time / 160 ms")
    args = ap.parse_args(argv)
    schedules = [
        ("fixed 3, 12", ChunkSchedule(3, 12, True), "steady"),
        ("fixed 3, 3", ChunkSchedule(3, 3, True), "steady"),
        ("rule 3, cap 12", ChunkSchedule(3, 12), "buffered"),
        ("rule 3, cap 24", ChunkSchedule(3, 24), "buffered"),
    ]
    if args.segments > 1:
        schedules.append(("rule 3, cap 12, later segments fresh", ChunkSchedule(3, 12), "fresh"))
    print(f"{args.patches} patches in {args.segments} segment(s), {args.streams} streams per row, jitter "
          f"+-{args.jitter:g}, prefill {args.prefill:g} steps, floor {args.floor * 1000:g} ms, a chunk arrives "
          "one step + floor after its step\n")  # fmt: skip
    print("| schedule | r | streams stalled | worst gap ms | stall ms per stream | chunks per stream | largest |")
    print("|---|---|---|---|---|---|---|")
    for r in args.ratios:
        for label, schedule, how in schedules:
            print(row(label, schedule, r, args, how))
    return 0


if __name__ == "__main__":
    sys.exit(main())
