"""``python -m bench.read_ahead``: one long text (``--segments`` sentences; ``split_tokens`` 12 cuts each into
about 5 segments, 200 for the default 40) spoken with
``read_ahead`` K = 1, 4, 8 (``--ks``), on a server it starts for ``--preset`` (:mod:`bench.server`: the stop
head never fires, so each segment is exactly ``--max-patches`` long) or, with ``--offline``, in this process.

Prints a markdown table: the wall time of the whole request, audio seconds per wall second, and how the
audio compares with K = 1's (bytes equal; else the 16-bit samples that differ and the largest difference).
Fixed chunks (``chunk_fixed``), so that chunk sizes do not move the numbers. In-process every stream is
stepped alone (no batching: no speed-up, and the bytes are equal); on a server the segments side by side
share generator steps, and the bytes are equal in its batch-invariant mode (the default;
``--no-batch-invariant`` measures the server without it: faster steps, float-close audio).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from engine.protocol import SAMPLE_RATE


def long_text(segments: int) -> str:
    return " ".join(f"Sentence number {n} is spoken here, one of several in a row." for n in range(segments))


def count_segments(preset: str, text: str, max_patches: int) -> int:
    """The segments the front end makes of ``text`` (as the server's, with split_tokens 12)."""
    from bench.server import nostop_checkpoint
    from engine.frontend import prepare
    from engine.text import TextTokenizer

    tokenizer = TextTokenizer.from_dir(nostop_checkpoint(preset) / "text_tokenizer")
    return len(prepare(text, None, lambda t: len(tokenizer.encode(t)), 12, max_patches=max_patches).segments)


def pcm16(audio: np.ndarray) -> np.ndarray:
    return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype(np.int32)


def table(rows: list[dict]) -> str:
    out = ["| read_ahead | wall s | audio s | audio s / wall s | vs read_ahead 1 |", "|---|---|---|---|---|"]
    base = rows[0]["audio"]
    for r in rows:
        a = r["audio"]
        if a.shape != base.shape:
            same = f"length differs ({a.shape[0]} vs {base.shape[0]} samples)"
        elif a.tobytes() == base.tobytes():
            same = "bytes equal"
        else:
            differ = int((pcm16(a) != pcm16(base)).sum())
            same = (f"float max diff {np.abs(a - base).max():.1e}; {differ} of {a.size} 16-bit samples differ "
                    f"(at most {int(np.abs(pcm16(a) - pcm16(base)).max())} step)")  # fmt: skip
        secs = a.size / SAMPLE_RATE
        out.append(f"| {r['k']} | {r['wall']:.2f} | {secs:.1f} | {secs / r['wall']:.2f} | {same} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.read_ahead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--segments", type=int, default=40)
    ap.add_argument("--max-patches", type=int, default=6, help="patches per segment (160 ms each)")
    ap.add_argument("--ks", default="1,4,8", help="read_ahead values, the first is the baseline")
    ap.add_argument("--slots", type=int, default=8, help="the server's generator slots")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--offline", action="store_true", help="in this process instead of a server")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's batch-invariant mode (engine/invariant.py)")  # fmt: skip
    ap.add_argument("--synthetic-step", default="", metavar="COST",
                    help="a server with synthetic math whose step lasts COST (engine/step_cost.py: FIXED+ROW ms, "
                    "h100, l4): a GPU-like step's timing; its audio is made up, so equal bytes say little")  # fmt: skip
    args = ap.parse_args(argv)
    if args.synthetic_step and args.offline:
        ap.error("--synthetic-step times a server, not --offline")
    ks = [int(k) for k in args.ks.split(",")]
    text = long_text(args.segments)
    segments = count_segments(args.preset, text, args.max_patches)
    params = {"max_patches": args.max_patches, "split_tokens": 12, "chunk_fixed": True}
    rows = []
    if args.offline:
        import torch

        from bench.server import nostop_checkpoint
        from engine.fireredtts3 import FireRedTTS3
        from engine.params import GenerationParams
        from engine.synthesize import synthesize

        torch.set_num_threads(1)
        model = FireRedTTS3.from_checkpoint(nostop_checkpoint(args.preset))
        gp = GenerationParams(seed=args.seed, max_patches=args.max_patches)
        for k in ks:
            t0 = time.perf_counter()
            audio = synthesize(model, text, params=gp, split_tokens=12, read_ahead=k)
            rows.append({"k": k, "wall": time.perf_counter() - t0, "audio": audio})
            print(f"read_ahead {k}: {rows[-1]['wall']:.2f} s", file=sys.stderr, flush=True)
    else:
        from bench.server import local_server
        from client import TTSClient

        synthetic = {"synthetic_math": True, "synthetic_step": args.synthetic_step} if args.synthetic_step else {}
        invariant = "on" if args.batch_invariant else "off"
        with local_server(
            args.preset, args.slots, read_ahead_cap=max(ks), batch_invariant=invariant, **synthetic
        ) as server:
            client = TTSClient(f"127.0.0.1:{server.ports.grpc}", "grpc", timeout=600)
            client.synthesize("Warm up.", seed=args.seed, parameters={"max_patches": 2})
            for k in ks:
                t0 = time.perf_counter()
                audio = client.synthesize(text, seed=args.seed, parameters={**params, "read_ahead": k})
                rows.append({"k": k, "wall": time.perf_counter() - t0, "audio": audio})
                print(f"read_ahead {k}: {rows[-1]['wall']:.2f} s", file=sys.stderr, flush=True)
    mode = "batch-invariant" if args.batch_invariant else "not batch-invariant"
    where = "in-process" if args.offline else f"server, {args.slots} slots, {mode}"
    if args.synthetic_step:
        where += f", synthetic math with a {args.synthetic_step} ms step"
    print(f"{args.segments} sentences, {segments} segments of {args.max_patches} patches (the front end cuts a "
          f"sentence longer than max_patches), {args.preset} preset, {where}\n")  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
