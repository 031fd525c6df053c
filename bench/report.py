"""The benchmark's outputs: a markdown table and a plot of first-chunk latency, throughput and underruns, against
concurrency (closed loop: :func:`markdown`, :func:`plot`) or against the arrival rate (open loop:
:func:`open_loop_markdown`, :func:`open_loop_plot`)."""

from __future__ import annotations

import math
from pathlib import Path

from bench.load import FAILURE_KINDS


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


def open_loop_markdown(rows: list[dict], title: str, notes: list[str]) -> str:
    """``rows``: :meth:`bench.openloop.RateLevelResult.summary` dicts, one per target rate."""
    lines = [f"### {title}", "", *(f"- {n}" for n in notes), ""]
    head = ("target req/s", "sent", "complete", "achieved req/s", "first audio p50 (ms)", "p95 (ms)", "p99 (ms)",
            "RTF p50", "RTF p95", "underrun streams", "continuity OK", "worst gap (ms)",
            *FAILURE_KINDS)  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        fc, rtf = r["first_chunk_ms"], r["rtf"]
        cells = [f"{r['rate']:g}", str(r["requests"]), str(r["complete"]), _f(r["achieved_rps"], 2), _f(fc["p50"]),
                 _f(fc["p95"]), _f(fc["p99"]), _f(rtf["p50"], 3), _f(rtf["p95"], 3), str(r["underruns"]),
                 _percent(r["continuity_ok_rate"]), _f(r["worst_gap_ms"]),
                 *(str(r["failures"][kind]) for kind in FAILURE_KINDS)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _percent(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f} %"


def open_loop_plot(rows: list[dict], title: str, path: Path) -> None:
    """Against the target rate: first-audio p50/p95/p99, achieved rate (the diagonal: keeping up; the
    offered rate shows the Poisson draw's own spread), and the shares of streams that underran, stayed
    continuous (no gap over 100 ms) or failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = [r["rate"] for r in rows]
    fig, (lat, thr, stalls) = plt.subplots(1, 3, figsize=(16, 4.2), constrained_layout=True)
    for q, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
        lat.plot(rate, [r["first_chunk_ms"][q] for r in rows], style, label=q)
    lat.set(xlabel="target requests/s", ylabel="first audio (ms)", title="first-audio latency")
    lat.legend()
    thr.plot(rate, [r["achieved_rps"] for r in rows], "o-", color="tab:green", label="achieved")
    thr.plot(rate, rate, color="grey", lw=0.8, ls="--", label="target")  # on this line the server keeps up
    thr.plot(rate, [r["offered_rps"] for r in rows], "x", color="grey", label="offered (sent / duration)")
    thr.set(xlabel="target requests/s", ylabel="complete streams / s", title="achieved rate")
    thr.legend()
    sent = [max(1, r["requests"]) for r in rows]
    complete = [max(1, r["complete"]) for r in rows]
    stalls.plot(rate, [r["underruns"] / c for r, c in zip(rows, complete, strict=True)], "o-", color="tab:red",
                label="underran")  # fmt: skip
    stalls.plot(rate, [r["continuity_ok_rate"] for r in rows], "s-", color="tab:blue", label="continuity OK")
    stalls.plot(rate, [r["errors"] / n for r, n in zip(rows, sent, strict=True)], "x:", color="black", label="failed")
    stalls.set(xlabel="target requests/s", ylabel="share of streams", title="stalls and failures", ylim=(-0.02, 1.02))
    stalls.legend()
    for ax in (lat, thr, stalls):
        ax.set_xscale("log")
        ax.set_xticks(rate, [f"{x:g}" for x in rate])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    lat.set_ylim(bottom=0)
    thr.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
