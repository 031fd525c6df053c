"""The benchmark's outputs: a markdown table and a plot of first-chunk latency, throughput and underruns."""

from __future__ import annotations

import math
from pathlib import Path


def _f(x: float, digits: int = 0) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"  # NaN: no successful stream at that level


def markdown(rows: list[dict], title: str, notes: list[str]) -> str:
    """``rows``: :meth:`bench.load.LevelResult.summary` dicts, one per concurrency."""
    lines = [f"### {title}", "", *(f"- {n}" for n in notes), ""]
    head = ("streams", "requests", "errors", "first chunk p50 (ms)", "p90 (ms)", "p99 (ms)", "RTF p50", "RTF p90",
            "underrun streams", "worst gap (ms)", "audio s / wall s")  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        fc, rtf = r["first_chunk_ms"], r["rtf"]
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {_f(fc['p50'])} | {_f(fc['p90'])} | "
            f"{_f(fc['p99'])} | {_f(rtf['p50'], 3)} | {_f(rtf['p90'], 3)} | {r['underruns']} | "
            f"{_f(r['worst_gap_ms'])} | {_f(r['audio_s_per_wall_s'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], title: str, path: Path, slots: int | None = None) -> None:
    """First-chunk p50/p90/p99 and aggregate throughput against concurrency, side by side; ``slots``
    (the server's generator slots, when known) is marked: past it, streams queue for a slot."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (lat, thr, gaps) = plt.subplots(1, 3, figsize=(16, 4.2), constrained_layout=True)
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
        lat.plot(c, [r["first_chunk_ms"][q] for r in rows], style, label=q)
    lat.set(xlabel="concurrent streams", ylabel="first chunk (ms)", title="first-chunk latency", xscale="log")
    thr.plot(c, [r["audio_s_per_wall_s"] for r in rows], "o-", color="tab:green")
    thr.axhline(1.0, color="grey", lw=0.8, ls="--")  # below this line the server cannot keep up in real time
    thr.set(xlabel="concurrent streams", ylabel="audio s / wall s", title="aggregate throughput", xscale="log")
    gaps.bar([str(x) for x in c], [r["underruns"] / max(1, r["requests"] - r["errors"]) for r in rows],
             color="tab:red")  # fmt: skip
    gaps.set(xlabel="concurrent streams", ylabel="share of streams", title="streams with an underrun", ylim=(0, 1))
    for ax in (lat, thr):
        if slots:
            ax.axvline(slots, color="grey", lw=0.8, ls=":", label=f"{slots} slots")
        ax.set_xticks(c, [str(x) for x in c])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    lat.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
