"""Memory of the launcher's processes over a soak, per process (loadtest/soak.sh).

    python -m loadtest.rss_sampler sample --launcher PID --csv FILE [--every 30]
    python -m loadtest.rss_sampler report FILE [--from SECONDS]

``sample`` writes one row per process of the launcher's tree (the launcher, tritonserver, each Python
backend stub named by its model, the gateway) every EVERY seconds, plus a row ``shm`` with the Python
backend's shared-memory regions of that server under /dev/shm (their allocated pages: RSS counts the
pages a process touched there, so a region that grows shows in every process that maps it). It samples
once more and stops on SIGTERM or when the launcher is gone. ``report`` prints start / 25 % / 50 % / 75 % /
end of each, and the sum of tritonserver and its stubs; ``--from`` takes the start that many seconds in.

Columns: seconds since the first sample, label, pid, VmRSS, RssAnon, RssFile, RssShmem, Pss (MB; for
``shm`` the allocated MB, its size in MB in ``file``, and the number of regions in ``pid``). RSS counts a
page every process maps in each of them (the stubs' shared libraries, the shm regions): the sum of RSS
counts those more than once, the sum of PSS once.
"""

from __future__ import annotations

import argparse
import csv
import signal
import sys
import threading
import time
from pathlib import Path

FIELDS = ["seconds", "label", "pid", "rss_mb", "anon_mb", "file_mb", "shmem_mb", "pss_mb"]
SERVER = ("tritonserver",)  # the labels summed with the stubs (``stub:*``)
PSS = "tritonserver + stubs, PSS"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def label(pid: int, launcher: int) -> str:
    """launcher, tritonserver, stub:<model> (the generator under its plain name, not its secret one), the
    module of a ``python -m`` (gateway, supervise), or the program's name."""
    if pid == launcher:
        return "launcher"
    argv = _cmdline(pid)
    if not argv:
        return "?"
    program = Path(argv[0]).name
    if program == "tritonserver":
        return program
    if program == "triton_python_backend_stub" and len(argv) > 1:
        # argv[1] is <repository>/<model>/<version>/model.py
        model = Path(argv[1]).parent.parent.name
        return "stub:" + ("generator" if model.startswith("generator-") else model)
    if "-m" in argv and argv.index("-m") + 1 < len(argv):  # python -m gateway, -m serving.supervision.supervise
        return argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    return program


def _memory(pid: int) -> tuple[float, ...] | None:
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                values[key] = int(rest.split()[0]) / 1024
    except OSError:
        return None
    if "VmRSS" not in values:  # a zombie
        return None
    try:  # the proportional share: a page mapped by N processes counts 1/N in each (libraries, shm regions)
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                values["Pss"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return tuple(round(values.get(k, 0.0), 1) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Pss"))


def sample(launcher: int, shm_dir: Path = Path("/dev/shm")) -> list[list]:
    """One row per process of the launcher's tree, and one for its server's shared-memory regions."""
    children, rows, todo = _children(), [], [launcher]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        memory = _memory(pid)
        if memory is not None:
            rows.append([label(pid, launcher), pid, *memory])
    # serving.supervision.triton_env.TritonServer.shm_prefix: tts<pid of the launcher>_<grpc port>_
    allocated = size = count = 0
    for segment in shm_dir.glob(f"tts{launcher}_*"):
        try:
            st = segment.stat()
        except OSError:
            continue
        allocated, size, count = allocated + st.st_blocks * 512, size + st.st_size, count + 1
    rows.append(["shm", count, round(allocated / 2**20, 1), 0.0, round(size / 2**20, 1), 0.0, 0.0])
    return rows


def run(launcher: int, path: Path, every: float) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    start = time.monotonic()
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(FIELDS)
        while True:
            if not Path(f"/proc/{launcher}").exists():
                return
            seconds = round(time.monotonic() - start)
            out.writerows([seconds, *row] for row in sample(launcher))
            f.flush()
            if stop.is_set() or stop.wait(every):
                if stop.is_set() and seconds != round(time.monotonic() - start):
                    out.writerows([round(time.monotonic() - start), *row] for row in sample(launcher))
                return


def read(path: Path) -> dict[int, dict[str, float]]:
    """seconds -> label -> RSS MB (processes with one label summed: a restarted stub's two lives), and
    ``PSS`` -> the PSS of tritonserver and its stubs."""
    samples: dict[int, dict[str, float]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            at = samples.setdefault(int(row["seconds"]), {})
            at[row["label"]] = at.get(row["label"], 0.0) + float(row["rss_mb"])
            if row.get("pss_mb") and (row["label"] in SERVER or row["label"].startswith("stub:")):
                at[PSS] = at.get(PSS, 0.0) + float(row["pss_mb"])
    return samples


def _change(before: float | None, after: float | None) -> str:
    if not before or after is None:
        return ""
    return f"{after - before:+.0f} ({(after / before - 1) * 100:+.0f} %)"


def report(path: Path, start_at: float = 0.0) -> str:
    """A table of each process's RSS at the start, 25 / 50 / 75 % and the end. With ``start_at`` the start
    is the first sample that many seconds in (after the warm-up), and the sample at ready stays as the
    first column, with the change from it."""
    samples = read(path)
    everything = sorted(samples)
    times = [t for t in everything if t >= start_at] or everything
    if not times:
        return "rss: no samples"
    first, last = times[0], times[-1]
    marks = [min(times, key=lambda t: abs(t - (first + q * (last - first)))) for q in (0, 0.25, 0.5, 0.75, 1)]
    ready = everything[0] if everything[0] < first else None
    labels = sorted(
        {k for t in everything for k in samples[t]} - {PSS}, key=lambda k: (k == "shm", k.startswith("stub:"), k)
    )
    for t in everything:
        samples[t]["tritonserver + stubs"] = sum(
            v for k, v in samples[t].items() if k in SERVER or k.startswith("stub:")
        )
    labels.append("tritonserver + stubs")
    if any(PSS in samples[t] for t in everything):
        labels.append(PSS)
    columns = ([ready] if ready is not None else []) + marks
    head = ["MB at", *(f"{t // 60}:{t % 60:02d}" for t in columns), "end - start"]
    if ready is not None:
        head.append("end - ready")
    lines = [head]
    for k in labels:
        values = [samples[t].get(k) for t in columns]
        line = [k + (" (allocated)" if k == "shm" else ""), *("-" if v is None else f"{v:.0f}" for v in values)]
        line.append(_change(samples[first].get(k), values[-1]))
        if ready is not None:
            line.append(_change(values[0], values[-1]))
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join(
        "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in lines
    )
    note = (
        f"; start {first // 60}:{first % 60:02d} in, after the warm-up (the first column: at ready)"
        if ready is not None
        else ""
    )
    return f"RSS per process, {len(everything)} samples{note}:\n{text}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="sample until SIGTERM or the launcher's exit")
    s.add_argument("--launcher", type=int, required=True, help="the pid of python -m serving.serve")
    s.add_argument("--csv", type=Path, required=True)
    s.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    r = sub.add_parser("report", help="print start / 25 %% / 50 %% / 75 %% / end of a CSV")
    r.add_argument("csv", type=Path)
    r.add_argument("--from", dest="start_at", type=float, default=0.0, help="take the start this many s in")
    args = parser.parse_args(argv)
    if args.command == "sample":
        run(args.launcher, args.csv, args.every)
    else:
        print(report(args.csv, args.start_at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
