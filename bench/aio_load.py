"""Load from one asyncio event loop: every stream a task on one gRPC channel (:class:`client.AsyncTTSClient`),
where :mod:`bench.load` and :mod:`bench.openloop` give each stream a thread and a channel of its own.

At hundreds of streams the threaded client costs more CPU than the server it measures (512 streams: 0.73
ms per stream-step, against 0.3 for all of the server's processes), on the same cores. Here a stream costs
a task and its responses; :class:`LoadProcess` runs the loop in a process of its own, so its CPU is counted
apart from the benchmark's (``/proc``) and its work does not wait on the benchmark's GIL.

Streams are judged exactly as the threaded ones (:class:`bench.load.Listener`: the first chunk the only
buffer, :func:`bench.load.worst_gap`, :func:`bench.load.failure_kind`), closed loop (:func:`run_level`) or
open loop (:func:`run_rate`).

``python -m bench.aio_load --url HOST:PORT`` is that process: one JSON command per line on stdin, one JSON
answer per line on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from bench.load import LevelResult, Listener, StreamResult
from bench.openloop import Arrival, RateLevelResult, ScheduledStream
from client.aio import AsyncTTSClient


async def one_stream(
    client: AsyncTTSClient, text: str, seed: int, request: dict, cancel: asyncio.Event | None = None
) -> StreamResult:
    """:func:`bench.load.one_stream` on the event loop: ``cancel``, once set, ends the stream at its next
    chunk as a timeout (leaving the iteration cancels the request on the server)."""
    listener = Listener()
    try:
        async for chunk in client.stream(text, seed=seed, **request):
            if cancel is not None and cancel.is_set():
                raise TimeoutError("still streaming when the benchmark stopped waiting")
            listener.heard(chunk)
        listener.ended()
    except Exception as e:  # a failed stream is a data point (an error), not the end of the benchmark
        return listener.result(e)
    return listener.result()


class Progress:
    """Counts ended streams for ``progress(done, errors, total)``."""

    def __init__(self, total: int, progress: Callable[[int, int, int], None] | None):
        self.total, self.progress, self.done, self.errors = total, progress, 0, 0

    def ended(self, result: StreamResult) -> None:
        self.done += 1
        self.errors += result.error is not None
        if self.progress:
            self.progress(self.done, self.errors, self.total)


async def run_level(
    client: AsyncTTSClient, concurrency: int, requests: int, texts: list[str], request: dict,
    progress: Callable[[int, int, int], None] | None = None,
) -> LevelResult:  # fmt: skip
    """:func:`bench.load.run_level`: ``requests`` streams, at most ``concurrency`` in flight."""
    gate, count = asyncio.Semaphore(concurrency), Progress(requests, progress)

    async def job(i: int) -> StreamResult:
        async with gate:
            result = await one_stream(client, texts[i % len(texts)], seed=i, request=request)
        count.ended(result)
        return result

    t0 = time.perf_counter()
    results = await asyncio.gather(*(job(i) for i in range(requests)))
    return LevelResult(concurrency, time.perf_counter() - t0, tuple(results))


async def run_rate(
    client: AsyncTTSClient, arrivals: list[Arrival], rate: float, duration: float, request: dict,
    drain_timeout: float, progress: Callable[[int, int, int], None] | None = None,
) -> RateLevelResult:  # fmt: skip
    """:func:`bench.openloop.run_rate`: each arrival sent at its time whatever runs; after ``duration`` s the
    streams in flight get ``drain_timeout`` s more, then end at their next chunk as timeouts."""
    cancel, count = asyncio.Event(), Progress(len(arrivals), progress)
    t0 = time.perf_counter()

    async def job(arrival: Arrival, sent: float) -> ScheduledStream:
        result = await one_stream(client, arrival.text, arrival.seed, request, cancel)
        count.ended(result)
        return ScheduledStream(arrival, sent, result)

    tasks = []
    for arrival in arrivals:
        await asyncio.sleep(max(0.0, arrival.at - (time.perf_counter() - t0)))
        tasks.append(asyncio.ensure_future(job(arrival, time.perf_counter() - t0)))
    drain_until = t0 + max(duration, time.perf_counter() - t0) + drain_timeout
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, drain_until - time.perf_counter()))
    cancel.set()
    streams = tuple(await asyncio.gather(*tasks))  # each ends at its next chunk or at the client's timeout
    wall = max([duration] + [s.sent + s.result.total for s in streams])
    return RateLevelResult(rate, duration, wall, streams)


# ---- the load process ----
def _stderr_progress(label: str) -> Callable[[int, int, int], None]:
    from bench.load import console_progress

    return console_progress(label)


async def _serve(url: str, response_timeout: float, commands, answers) -> None:
    """Answer each command line of ``commands`` with one line on ``answers`` (see :class:`LoadProcess`)."""
    loop = asyncio.get_running_loop()
    async with AsyncTTSClient(url, timeout=response_timeout) as client:
        answers.write(json.dumps({"ready": True}) + "\n")  # imports done: what it costs from here is load
        answers.flush()
        while line := await loop.run_in_executor(None, commands.readline):
            command = json.loads(line)
            cpu = time.process_time()
            if command["kind"] == "level":
                n = command["concurrency"]
                level = await run_level(client, n, command["requests"], command["texts"], command["request"],
                                        _stderr_progress(f"concurrency {n:>3}"))  # fmt: skip
                answer = {"wall": level.wall, "streams": [asdict(s) for s in level.streams]}
            elif command["kind"] == "rate":
                arrivals = [Arrival(**a) for a in command["arrivals"]]
                rate = command["rate"]
                level = await run_rate(client, arrivals, rate, command["duration"], command["request"],
                                       command["drain_timeout"], _stderr_progress(f"rate {rate:g}/s"))  # fmt: skip
                answer = {"wall": level.wall, "streams": [
                    {"arrival": asdict(s.arrival), "sent": s.sent, "result": asdict(s.result)} for s in level.streams
                ]}  # fmt: skip
            else:
                answer = {"error": f"unknown command {command['kind']!r}"}
            answer["cpu_s"] = time.process_time() - cpu
            answers.write(json.dumps(answer) + "\n")
            answers.flush()


class LoadProcess:
    """The asyncio load client in a process of its own (``python -m bench.aio_load``), driven over its
    stdin and stdout; ``pid`` is the process to read CPU time of. A context manager: the process ends with it."""

    def __init__(self, url: str, timeout: float):
        cmd = [sys.executable, "-m", "bench.aio_load", "--url", url, "--timeout", str(timeout)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        if not self.proc.stdout.readline():
            raise RuntimeError(f"the load process did not start (exit status {self.proc.wait()})")

    def __enter__(self) -> LoadProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load process ended (exit status {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def level(self, concurrency: int, requests: int, texts: list[str], request: dict) -> LevelResult:
        """:func:`run_level` in the load process."""
        answer = self._ask({"kind": "level", "concurrency": concurrency, "requests": requests, "texts": texts,
                            "request": request})  # fmt: skip
        return LevelResult(concurrency, answer["wall"], tuple(StreamResult(**s) for s in answer["streams"]))

    def rate(
        self, arrivals: list[Arrival], rate: float, duration: float, request: dict, drain_timeout: float
    ) -> RateLevelResult:
        """:func:`run_rate` in the load process."""
        answer = self._ask({"kind": "rate", "arrivals": [asdict(a) for a in arrivals], "rate": rate,
                            "duration": duration, "request": request, "drain_timeout": drain_timeout})  # fmt: skip
        streams = tuple(ScheduledStream(Arrival(**s["arrival"]), s["sent"], StreamResult(**s["result"]))
                        for s in answer["streams"])  # fmt: skip
        return RateLevelResult(rate, duration, answer["wall"], streams)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.aio_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server's gRPC HOST:PORT")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each response")
    args = ap.parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the answers' own copy of stdout
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # so that a stray print cannot break a line of them
    asyncio.run(_serve(args.url, args.timeout, sys.stdin, answers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
