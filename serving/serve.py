"""Launch the Triton server for a checkpoint: ``python -m serving.serve [--checkpoint DIR] ...``.

Renders the model repository for the options, finds ``tritonserver`` (see :mod:`serving.triton_env`),
runs it in explicit model-control mode and forwards SIGINT/SIGTERM, so no server outlives the launcher.
Without ``--checkpoint`` the tiny random-weight checkpoint is generated on first use in the cache.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from engine.config import cache_dir
from serving.repository import ServeOptions, build
from serving.triton_env import Ports, TritonServer
from serving.voice_store import default_dir as default_voice_dir


def default_checkpoint() -> Path:
    """The tiny checkpoint in the cache, written on first use."""
    from engine.checkpoint import cached_checkpoint

    return cached_checkpoint("tiny", cache_dir() / "checkpoints" / "tiny-seed0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="official-layout folder (default: the tiny checkpoint)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--slots", type=int, default=8, help="generator streams batched together")
    ap.add_argument("--max-len", type=int, default=2048, help="backbone positions per slot")
    ap.add_argument(
        "--voice-dir", type=Path, default=None, help="voice store (default: ~/.cache/fireredtts3-triton/voices)"
    )
    ap.add_argument("--max-anonymous-voices", type=int, default=256, help="LRU bound of stored reference prompts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the rendered repository and logs go")
    args = ap.parse_args(argv)

    ckpt = (args.checkpoint or default_checkpoint()).resolve()
    if not ckpt.is_dir():
        ap.error(f"checkpoint folder not found: {ckpt}")
    voice_dir = (args.voice_dir or default_voice_dir()).resolve()
    work = (args.work_dir or cache_dir() / "run" / f"{args.grpc_port}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    opts = ServeOptions(checkpoint=str(ckpt), slots=args.slots, max_len=args.max_len, voice_dir=str(voice_dir), device=args.device,
                        max_anonymous_voices=args.max_anonymous_voices,
                        cancel_dir=str(work / "cancel"))  # fmt: skip
    repo = build(work / "model_repository", opts)
    server = TritonServer(repo, work, Ports(args.http_port, args.grpc_port, args.metrics_port), host=args.host,
                          log_path=work / "tritonserver.log")  # fmt: skip
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting tritonserver (checkpoint {ckpt}); log: {server.log_path}", file=sys.stderr, flush=True)
    server.start()
    try:
        t0 = time.monotonic()
        while stop["sig"] is None and not server.is_ready():
            time.sleep(0.25)
        if stop["sig"] is None:
            print(
                f"ready in {time.monotonic() - t0:.1f} s: gRPC {args.host}:{args.grpc_port}, "
                f"HTTP http://{args.host}:{args.http_port}, metrics http://{args.host}:{args.metrics_port}/metrics",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        while stop["sig"] is None and server.proc.poll() is None:
            time.sleep(0.5)
        if server.proc.poll() is not None and stop["sig"] is None:
            print(f"tritonserver exited with {server.proc.returncode}; log tail:\n{server.log_tail()}", file=sys.stderr)
            return 1
        return 0
    finally:
        server.stop()
        print("tritonserver stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
