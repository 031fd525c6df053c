"""Start-of-request cost of a reference voice: encoded per request vs served from the voice store.

    python bench/voice_start.py --preset tiny [--ref-seconds 5] [--repeats 8]

Starts a server on free ports with a fresh voice directory and prints, per case, the median time from
sending the request to the first audio chunk (max_patches 6), plus the in-process encode and load times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import TTSClient  # noqa: E402
from client.voices import VoiceClient  # noqa: E402
from engine.random_checkpoint import make_checkpoint  # noqa: E402
from serving.config.repository import ServeOptions, build  # noqa: E402
from serving.supervision.triton_env import Ports, TritonServer  # noqa: E402


def clip(seed: int, seconds: float) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)


def first_chunk(client: TTSClient, **kw) -> float:
    it = client.stream("Start latency", seed=1, parameters={"max_patches": 6}, **kw)
    t = next(it).arrival
    for _ in it:
        pass
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--ref-seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="voice-start-"))
    ck = make_checkpoint(args.preset, work / "ck")

    import torch

    from engine.fireredtts3 import FireRedTTS3
    from serving.voices.voice_store import VoiceStore

    torch.set_num_threads(1)
    model = FireRedTTS3.from_checkpoint(ck, parts=("encoder", "campp"))
    store = VoiceStore(work / "inproc", model.identity, model.encode_prompt)
    ref = clip(0, args.ref_seconds)
    t0 = time.perf_counter()
    store.register("v", ref, 16000, "text")
    enc = time.perf_counter() - t0
    loads = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        store.get("v")
        loads.append(time.perf_counter() - t0)

    repo = build(
        work / "repo",
        ServeOptions(checkpoint=str(ck), slots=4, voice_dir=str(work / "voices"), cancel_dir=str(work / "cancel")),
    )
    with TritonServer(repo, work, Ports.free()) as srv:
        url = f"127.0.0.1:{srv.ports.grpc}"
        client = TTSClient(url, timeout=120)
        VoiceClient(url, admin_key=srv.admin_key).add("stored", ref, 16000, "text")
        first_chunk(client)  # warm-up
        fresh = [first_chunk(client, ref_audio=clip(100 + i, args.ref_seconds), ref_sample_rate=16000, ref_text="text")
                 for i in range(args.repeats)]  # fmt: skip
        anon = [first_chunk(client, ref_audio=ref, ref_sample_rate=16000, ref_text="text") for _ in range(args.repeats)]
        named = [first_chunk(client, voice_id="stored") for _ in range(args.repeats)]
        silent = [first_chunk(client) for _ in range(args.repeats)]
    ms = lambda xs: f"{1000 * statistics.median(xs):.1f}"  # noqa: E731
    print(f"\n{args.preset}, {args.ref_seconds:.0f} s reference, median of {args.repeats}\n")
    print("| case | first chunk (ms) |\n|---|---|")
    print(f"| new reference (encoded in the request) | {ms(fresh)} |")
    print(f"| same reference again (stored, anonymous) | {ms(anon)} |")
    print(f"| VOICE_ID (stored, named) | {ms(named)} |")
    print(f"| no reference (silent prompt) | {ms(silent)} |")
    print(f"\nin-process: encode {1000 * enc:.1f} ms, load from store {ms(loads)} ms")


if __name__ == "__main__":
    main()
