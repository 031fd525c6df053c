"""Per-step overhead of the served generator against the same batched step called in-process. (Over
300 lines: one measurement taken three ways, in-process, through Triton and end to end, which share
their set-up.)

For every preset (nostop variants: the stop head never fires, so each stream runs exactly P patches)
and every stream count N, it measures:

- in-process: ``GeneratorService.step`` over N streams until all finish (the floor);
- ``generator`` over gRPC: N concurrent streaming requests straight to the generator model (one
  decoupled request per stream, stepped by the model's engine thread: serving.stub.generator_host; their
  chunks on one pipe, as tts reads them), wall time from the first request sent to the last stream's last
  chunk; the model's
  ``tts_generator_step_seconds`` histogram splits that into in-model step time and the rest (admission,
  tensors, responses, gRPC);
- end to end (``--e2e``): N TTSClient streams through ``tts`` with chunk_first = chunk_next = P, so
  the vocoder runs once per stream (its time and the prompt encoder's are in this column too).

Every ms/step figure is wall time / P (a batched step advances all N streams by one patch). The
repetitions of all variants are interleaved (best kept) so that drifting machine load hits them alike.
Columns: "overhead" = wall - in-model step time (per stream: / N); "steps" is the step histogram's
count (P when every stream was batched from step 1; more when admissions split the first steps);
"lost vs in-process" = 1 - in-process/Triton (noisy across processes); "overhead share" = overhead /
wall (same run, robust). Until the generator left Triton's iterative sequence batcher, this bench also
ran that path: 0.15 / 0.11 ms per stream per step at 64 / 256 streams against 0.01 ms for an engine
thread. Checkpoints, the model repository and server logs go to ``--work`` (default
results/step_overhead, git-ignored). Usage::

    .venv/bin/python -m bench.step_overhead [--presets tiny,small] [--streams 1,4,8] [--patches 48]
        [--reps 2] [--e2e]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the server's stubs run with one torch thread

import argparse
import itertools
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from client.tts_client import TTSClient
from engine.chunking import ChunkSchedule
from engine.config import nostop
from engine.fireredtts3 import FireRedTTS3
from engine.params import GenerationParams
from engine.random_checkpoint import make_checkpoint
from engine.streams import GeneratorService
from serving import contract
from serving.config.options import MAX_SLOTS
from serving.config.repository import ServeOptions, build
from serving.security.auth import Keys
from serving.stub.chunk_pipe import OPEN
from serving.stub.chunk_pipe import PARAMETER as PIPE
from serving.supervision.triton_env import Ports, TritonServer

TEXT = "The quick brown fox jumps over the lazy dog."
WARM = 6  # patches of a warm-up run (GenerationParams needs max_patches >= min_patches = 6)


# ---------------------------------------------------------------------------------------------------
@dataclass
class Row:
    preset: str
    n: int
    inproc: float = float("nan")  # s per step
    triton: float = float("nan")  # s per step, wall / P
    in_model: float = float("nan")  # s per step, histogram sum / P
    executes: float = float("nan")  # steps per run, histogram count (P when all streams were batched from step 1)
    e2e: float = float("nan")
    notes: list = field(default_factory=list)


def nostop_checkpoint(preset: str, work: Path) -> Path:
    p = nostop(preset)
    return make_checkpoint(p, work / "ckpt" / p.name, seed=0)


class InProcess:
    """GeneratorService.step over n streams until all finish, in this process (admission included)."""

    def __init__(self, ck: Path, slots: int, max_len: int, steps: int):
        torch.set_num_threads(1)
        self.model = FireRedTTS3.from_checkpoint(ck)
        self.prompt = self.model.encode_prompt(None)
        self.tokens = self.model.tokens(TEXT, "English", self.prompt)
        self.svc = GeneratorService(self.model, slots, max_len)
        self.steps = steps
        self.ids = itertools.count()

    def run(self, n: int, patches: int) -> float:
        """Wall seconds for n streams of ``patches`` patches."""
        svc, owners = self.svc, [next(self.ids) + 1 for _ in range(n)]
        t0 = time.perf_counter()
        for i, o in enumerate(owners):
            gp = GenerationParams(seed=1000 + i, steps=self.steps, max_patches=patches)
            svc.admit(o, self.tokens, self.prompt, gp, ChunkSchedule(patches, patches, fixed=True))
        live, k = owners, 0
        while live:
            out = svc.step(live)
            k += 1
            live = [o for o in live if out[o] is None or not out[o].last]
        dt = time.perf_counter() - t0
        assert k == patches, (k, patches)
        return dt


class GeneratorClient:
    """Concurrent streaming requests to the generator model over one gRPC stream, as tts sends them: one
    pipe (serving.stub.chunk_pipe) carries every stream's chunks; each stream's own request is answered,
    empty, once the generator admits it. The pipe is opened without a read receipt (unpaced: the T23
    deadlock is a BLS one, and this is a gRPC client)."""

    def __init__(self, srv: TritonServer, model: FireRedTTS3, cancel_dir: Path):
        import tritonclient.grpc as grpcclient

        self.g = grpcclient
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.ports.grpc}")
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._cb, stream_timeout=3600)
        prompt = model.encode_prompt(None)
        self.latents = prompt.latents.float().numpy()[None]
        self.speaker = prompt.speaker.float().numpy()[None]
        self.seq = itertools.count(int(time.time()) << 20)
        self.internal = Keys(srv.internal_key).parameters()  # the generator as tts calls it
        self.generator = srv.generator_model  # its name in Triton, a secret of the run
        self.pipe, self.cancel_dir = next(self.seq), cancel_dir
        self.client.async_stream_infer(self.generator, self._inputs(0), request_id=f"p{self.pipe}",
                                       parameters={**self.internal, PIPE: OPEN}, sequence_id=self.pipe,
                                       sequence_start=True, enable_empty_final_response=True)  # fmt: skip
        now, rid, final, err = self.events.get(timeout=600)  # the opening, answered at once
        if err is not None or final:
            raise RuntimeError(f"the generator did not open a pipe: {err or 'it ended it'}")

    def _cb(self, result, error):
        """Events ``(time, stream id or None, error)``: a stream whose last chunk came on the pipe, or a
        refusal (on the stream's own request, or the pipe's end)."""
        now = time.perf_counter()
        if error is not None:
            self.events.put((now, None, True, error))
            return
        resp = result.get_response()
        final = resp.parameters["triton_final_response"].bool_param
        if resp.id == f"p{self.pipe}":
            chunks = result.as_numpy("PIPE_CHUNKS")
            if final:
                self.events.put((now, None, True, "the generator ended the pipe"))
            elif chunks is None:
                self.events.put((now, None, False, None))  # the opening
            for row in () if chunks is None else chunks.reshape(-1, contract.PIPE_COLUMNS):
                if row[5]:  # the stream's last chunk
                    self.events.put((now, int(row[0]), True, None))
        elif final and result.as_numpy("FINISH_REASON") is not None:  # refused before it started
            self.events.put((now, None, True, result.as_numpy("FINISH_REASON").reshape(-1)[0].decode()))

    def _inputs(self, seed: int):
        arrs = {"TEXT": np.array([[TEXT.encode()]], np.object_), "PROMPT_LATENTS": self.latents,
                "SPEAKER": self.speaker, "PROMPT_TEXT": np.array([[b""]], np.object_),
                "SEED": np.array([[seed]], np.int64)}  # fmt: skip
        dt = {np.int64: "INT64", np.float32: "FP32", np.object_: "BYTES"}
        out = []
        for name, a in arrs.items():
            t = self.g.InferInput(name, list(a.shape), dt[a.dtype.type])
            t.set_data_from_numpy(a)
            out.append(t)
        return out

    def run(self, n: int, P: int, steps: int, timeout: float = 600.0) -> float:
        """Wall seconds from the first request sent to the last chunk of n streams."""
        reqs = [(next(self.seq), self._inputs(1000 + i)) for i in range(n)]
        params = {"max_patches": P, "chunk_first": P, "chunk_next": P, "steps": steps, **self.internal,
                  PIPE: f"{self.pipe:x}"}  # fmt: skip
        t0 = time.perf_counter()
        for sid, inputs in reqs:
            self.client.async_stream_infer(self.generator, inputs, request_id=f"r{sid}", parameters=params,
                                           sequence_id=sid, sequence_start=True,
                                           enable_empty_final_response=True)  # fmt: skip
        pending, last = {sid for sid, _ in reqs}, t0
        deadline = time.monotonic() + timeout
        while pending:
            try:
                now, sid, final, err = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"generator: {len(pending)} of {n} streams unfinished") from None
            if err is not None:
                raise RuntimeError(f"generator: {err}")
            if final and sid in pending:
                pending.discard(sid)
                last = now
        return last - t0

    def close(self):
        """The generator ends the pipe (a cancel mark, as tts's unload asks); the stream is stopped without
        waiting for it (a stop that waits for every request waits for the pipe's end)."""
        from serving.flow.side_channel import SideChannel

        SideChannel(self.cancel_dir).mark("cancel", self.pipe)
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def e2e_run(srv: TritonServer, n: int, P: int, steps: int) -> float:
    client = TTSClient(f"127.0.0.1:{srv.ports.grpc}", timeout=600)
    params = {"max_patches": P, "chunk_first": P, "chunk_next": P, "steps": steps}
    errors: list = []

    def one(i):
        try:
            client.synthesize(TEXT, seed=1000 + i, parameters=params)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"tts: {errors[0]}")
    return time.perf_counter() - t0


def measure(ck: Path, preset: str, rows: dict, args) -> None:
    """Start a server for ``ck`` and, per stream count, interleave the repetitions of every variant
    (in-process, generator, e2e) so that drifting machine load hits them alike."""
    work = args.work / f"triton-{preset}"
    work.mkdir(parents=True, exist_ok=True)
    opts = ServeOptions(checkpoint=str(ck), slots=args.slots, max_len=args.max_len, cancel_dir=str(work / "cancel"))
    repo = build(work / "model_repository", opts)
    local = InProcess(ck, args.slots, args.max_len, args.steps)
    srv = TritonServer(repo, work, Ports.free(), log_path=work / "tritonserver.log")
    if srv.log_path.exists():
        srv.log_path.unlink()
    P, steps = args.patches, args.steps

    def served(gc, metric, n, patches):
        m0 = srv.metrics(("tts_",))
        wall = gc.run(n, patches, steps)
        m1 = srv.metrics(("tts_",))
        s, c = (m1.get(f"{metric}_{k}", float("nan")) - m0.get(f"{metric}_{k}", 0.0) for k in ("sum", "count"))
        return wall, s, c

    with srv:
        gc = GeneratorClient(srv, local.model, Path(opts.cancel_dir))
        try:
            for n in args.streams:
                row = rows[(preset, n)]
                local.run(n, WARM)
                gc.run(n, WARM, steps)
                if args.e2e:
                    e2e_run(srv, n, WARM, steps)
                res: dict[str, list] = {"local": [], "gen": [], "e2e": []}
                for _ in range(args.reps):
                    res["local"].append(local.run(n, P))
                    res["gen"].append(served(gc, "tts_generator_step_seconds", n, P))
                    if args.e2e:
                        res["e2e"].append(e2e_run(srv, n, P, steps))
                row.inproc = min(res["local"]) / P
                wall, s, c = min(res["gen"], key=lambda x: x[0])
                row.triton, row.in_model, row.executes = wall / P, s / P, c
                if res["e2e"]:
                    row.e2e = min(res["e2e"]) / P
                print(f"  {preset} N={n}: in-process {row.inproc * 1e3:.2f} ms/step, triton {row.triton * 1e3:.2f} "
                      f"(in-model {row.in_model * 1e3:.2f}, {row.executes:.0f} steps), e2e {row.e2e * 1e3:.2f}; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        finally:
            gc.close()


def table(rows: list[Row], args) -> str:
    def ms(x):
        return "–" if math.isnan(x) else f"{x * 1e3:.2f}"

    def pct(x):
        return "–" if math.isnan(x) else f"{x * 100:.1f}%"

    head = ["preset", "streams", "in-process ms/step", "Triton ms/step", "in-model ms/step",
            "overhead ms/step (per stream)", "steps", "lost vs in-process", "overhead share"]  # fmt: skip
    if args.e2e:
        head += ["tts e2e ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        over = r.triton - r.in_model
        cells = [r.preset, str(r.n), ms(r.inproc), ms(r.triton), ms(r.in_model), f"{ms(over)} ({ms(over / r.n)})",
                 f"{r.executes:.0f}", pct(1 - r.inproc / r.triton), pct(over / r.triton)]  # fmt: skip
        if args.e2e:
            cells += [ms(r.e2e)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--patches", type=int, default=48, help="P: patches per stream (= batched steps per run)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per point (best is kept), after a short warm-up")
    ap.add_argument("--slots", type=int, default=8, help="generator slots, in-process and on the server")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="Euler steps of the flow head")
    ap.add_argument("--work", type=Path, default=REPO / "results" / "step_overhead")
    ap.add_argument("--e2e", action="store_true", help="also N TTSClient streams through tts (vocoder included)")
    args = ap.parse_args(argv)
    args.streams = [int(x) for x in args.streams.split(",")]
    if not max(args.streams) <= args.slots <= MAX_SLOTS:
        ap.error(f"every stream count must fit in --slots, at most {MAX_SLOTS}")
    torch.set_num_threads(1)
    rows: dict = {}
    t_start = time.perf_counter()
    for preset in args.presets.split(","):
        ck = nostop_checkpoint(preset, args.work)
        for n in args.streams:
            rows[(preset, n)] = Row(preset, n)
        print(f"{preset}: measuring ...", flush=True)
        measure(ck, preset, rows, args)
    print()
    print(f"P = {args.patches} patches per stream, {args.steps} flow steps, slots = {args.slots}, torch threads 1, "
          f"best of {args.reps}; {os.cpu_count()} CPUs; {time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print()
    print(table(list(rows.values()), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
