"""``python -m bench.responsiveness``: how quickly a server answers, against the bounds it is meant to keep.

The integration tests check what happens (a full server refuses with "busy", the gateway streams, an
ensemble error reaches the client); this measures how long it takes, which on a shared machine is no
pass/fail matter. Against a server it starts for ``--preset`` (see :mod:`bench.server`; ``--slots`` slots,
``--waiting`` places in the queue) it prints one table per check, with the measurement, its bound and
whether it was kept:

1. running streams with requests waiting: the longest gap between chunks of ``--slots`` running streams,
   alone and with ``--waiting`` more requests queued for a slot (waiting requests once stalled the running
   ones 10x, 72 -> 757 ms; bound 3x);
2. refused when full: slots and queue taken by long streams, how long one more request over gRPC, HTTP
   and the OpenAI-compatible gateway waits for its "server busy" (bound 5 s);
3. the gateway streams: time to the first bytes of a 200-patch utterance (bound 5 s; the whole takes far
   longer);
4. ensemble errors: how long a bad tts_ensemble request takes to fail at the client (bound 30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from client import ServerBusy, TTSClient, TTSError

STALL_RATIO = 3.0  # running streams' longest chunk gap, crowded / alone
BUSY_WITHIN = 5.0  # seconds: a request beyond slots + queue is refused
FIRST_AUDIO_WITHIN = 5.0  # seconds: the gateway's first bytes of a long utterance
ERROR_WITHIN = 30.0  # seconds: a bad tts_ensemble request fails at the client
LONG = {"max_patches": 400, "chunk_first": 1, "chunk_next": 1}  # a stream that runs until it is left
ENSEMBLE_ERRORS = {
    "unknown language": {"language": "Klingon"},
    "unknown parameter": {"parameters": {"split_tokens": 40}},
    "fractional steps": {"parameters": {"steps": 2.5}},
    "unknown voice": {"voice_id": "nobody"},
    "bad sample rate": {"ref_audio": np.zeros(100, np.float32), "ref_sample_rate": 5},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.responsiveness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "small"], default="tiny", help="checkpoint of the started server")
    ap.add_argument("--slots", type=int, default=4, help="generator slots = running streams (default 4)")
    ap.add_argument("--waiting", type=int, default=8, help="requests queued for a slot = the queue's places (8)")
    ap.add_argument("--device", default="cpu", help="device of the started server's models (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.slots < 1 or args.waiting < 1:
        ap.error("--slots and --waiting must be >= 1")
    return args


def in_parallel(fn: Callable[[int], object], n: int) -> list:
    """``fn(i)`` for i in 0..n-1, each on its own thread -> their results; the first error is raised."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(fn, range(n)))


def longest_gap(url: str, running: int, waiting: int) -> float:
    """Seconds: the longest time between consecutive chunks of any of ``running`` 30-patch streams, with
    ``waiting`` more requests sent half a second after them (when the running ones hold every slot)."""
    params = {"max_patches": 30, "chunk_first": 1, "chunk_next": 1}

    def one(i: int) -> list:
        if i < running:
            return list(TTSClient(url, timeout=120).stream(f"Running {i}", seed=i, parameters=params))
        time.sleep(0.5)
        return list(TTSClient(url, timeout=120).stream(f"Waiting {i}", seed=i, parameters={"max_patches": 3}))

    results = in_parallel(one, running + waiting)
    gaps = []
    for chunks in results[:running]:
        times = [c.arrival for c in chunks]
        gaps.append(max(b - a for a, b in itertools.pairwise(times)))
    return max(gaps)


def gateway(triton_url: str):
    """The OpenAI-compatible gateway in front of ``triton_url`` on a free loopback port -> a context of its base URL."""
    from gateway.server import in_thread

    return in_thread(triton_url)


@contextlib.contextmanager
def full(server, url: str, streams: int) -> Iterator[None]:
    """``streams`` long streams in flight (every slot and queue place taken) until the block ends."""
    stop = threading.Event()

    def consume(i: int) -> None:
        stream = TTSClient(url, timeout=120).stream(f"Long stream {i}", seed=i, parameters=LONG)
        try:
            for _ in stream:
                if stop.is_set():
                    break
        finally:
            stream.close()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.metrics().get("tts_requests_in_flight") != streams and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def busy_seconds(server, protocol: str, gateway_url: str) -> tuple[float, str]:
    """Seconds until one more request is answered, and how it was answered ("busy" or what else)."""
    t0 = time.perf_counter()
    if protocol == "gateway":
        import httpx

        r = httpx.post(f"{gateway_url}/v1/audio/speech", json={"input": "One too many", "max_patches": 4}, timeout=30)
        answer = "busy" if r.status_code == 503 else f"HTTP {r.status_code}"
        return time.perf_counter() - t0, answer
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    try:
        TTSClient(f"127.0.0.1:{port}", protocol, timeout=30).synthesize("One too many", parameters={"max_patches": 4})
        answer = "served"
    except ServerBusy:
        answer = "busy"
    except TTSError as e:
        answer = f"error: {str(e).splitlines()[0][:50]}"
    return time.perf_counter() - t0, answer


def first_audio_seconds(gateway_url: str) -> tuple[float, float]:
    """Seconds to the gateway's first bytes of a 200-patch utterance, and to its end."""
    import httpx

    body = {"input": "A long one", "response_format": "pcm", "max_patches": 200, "chunk_first": 1, "chunk_next": 1}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{gateway_url}/v1/audio/speech", timeout=120, json=body) as r:
        for data in r.iter_bytes():
            if first is None and data:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0


def error_seconds(url: str, kw: dict) -> tuple[float, str]:
    """Seconds until a bad tts_ensemble request fails at the client, and the start of its message."""
    t0 = time.perf_counter()
    try:
        TTSClient(url, timeout=60, model="tts_ensemble").synthesize("Hello", **kw)
        message = "no error"
    except TTSError as e:
        message = str(e).splitlines()[0][:60]
    return time.perf_counter() - t0, message


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def yes(kept: bool) -> str:
    return "yes" if kept else "**no**"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.server import local_server

    load_before = os.getloadavg()[0]
    with local_server(args.preset, args.slots, args.device, max_queue=args.waiting) as server:
        url = f"127.0.0.1:{server.ports.grpc}"
        print("warm-up, then running streams alone and crowded ...", file=sys.stderr, flush=True)
        longest_gap(url, args.slots, 0)
        alone, crowded = longest_gap(url, args.slots, 0), longest_gap(url, args.slots, args.waiting)
        with gateway(url) as gateway_url:
            print("refused when full ...", file=sys.stderr, flush=True)
            with full(server, url, args.slots + args.waiting):
                busy = {p: busy_seconds(server, p, gateway_url) for p in ("grpc", "http", "gateway")}
            print("the gateway's first audio ...", file=sys.stderr, flush=True)
            first, whole = first_audio_seconds(gateway_url)
        print("ensemble errors ...", file=sys.stderr, flush=True)
        errors = {name: error_seconds(url, kw) for name, kw in ENSEMBLE_ERRORS.items()}

    ratio = crowded / alone
    print(f"\n{args.preset} checkpoint (stop head off), {args.slots} slots, {args.waiting} queue places, {args.device}; "
          f"{os.cpu_count()} CPUs, 1-min load average before the run {load_before:.1f}\n")  # fmt: skip
    print("Running streams with requests waiting (longest gap between chunks)\n")
    head = ["running", "waiting", "alone ms", "crowded ms", "ratio", f"within {STALL_RATIO:.0f}x?"]
    row = [str(args.slots), str(args.waiting), f"{alone * 1e3:.0f}", f"{crowded * 1e3:.0f}", f"{ratio:.2f}",
           yes(ratio <= STALL_RATIO)]  # fmt: skip
    print(table(head, [row]))
    print(f"\nRefused when full ({args.slots + args.waiting} streams in flight, one more)\n")
    rows = [[p, answer, f"{s:.3f}", yes(answer == "busy" and s < BUSY_WITHIN)] for p, (s, answer) in busy.items()]
    print(table(["protocol", "answer", "seconds", f"busy within {BUSY_WITHIN:.0f} s?"], rows))
    print("\nThe gateway streams (200 patches, chunks of 1)\n")
    rows = [[f"{first:.2f}", f"{whole:.2f}", yes(first < FIRST_AUDIO_WITHIN)]]
    print(table(["first audio s", "whole utterance s", f"first within {FIRST_AUDIO_WITHIN:.0f} s?"], rows))
    print("\nEnsemble errors (tts_ensemble over gRPC)\n")
    rows = [[name, message, f"{s:.3f}", yes(s < ERROR_WITHIN)] for name, (s, message) in errors.items()]
    print(table(["request", "error", "seconds", f"within {ERROR_WITHIN:.0f} s?"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
