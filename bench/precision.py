"""What the precision policy costs in accuracy: ``python -m bench.precision`` (CPU; not a timing).

Runs the ``small`` preset (random weights) in float32, then with bfloat16 where
:func:`engine.checkpoint.precision_policy` puts it on CUDA (the backbone, the RedAE encoder), one network
at a time and together, and everything in bfloat16 for contrast, and prints the SNR against float32 of:
the prompt latents the encoder makes of a 3 s reference, the generated latents (first patch, all), and
the decoded audio. Random weights make the autoregressive loop chaotic, so the whole-stream numbers are
a lower bound of what a trained model shows; the first patch isolates one step's rounding.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench.gpu import decode, generate, moved, random_model, snr_db
from engine.protocol import SAMPLE_RATE

BF16 = torch.bfloat16
VARIANTS = {
    "backbone bf16": {"backbone": BF16},
    "encoder bf16": {"encoder": BF16},
    "policy (backbone + encoder bf16)": {"backbone": BF16, "encoder": BF16},
    "everything bf16": BF16,
}


def reference_clip(seconds: float = 3.0) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    rng = np.random.default_rng(0)
    voiced = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((140, 280, 420, 560), 1))
    return (0.2 * voiced * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)).astype(
        np.float32
    )


@torch.inference_mode()
def encode(model, audio: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(audio).to(model.device, model.dtypes["encoder"])[None]
    return model.models.redae.encoder(x)[0].float().cpu()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--patches", type=int, default=12, help="generated patches (160 ms each)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ref = random_model(args.preset, "cpu")
    clip = reference_clip(3.0 - 3.0 % 0.16)
    lat_ref, audio_ref = generate(ref, args.patches)
    prompt_ref = encode(ref, clip)
    lines = [
        "| variant | prompt latents SNR dB | first patch SNR dB | all latents SNR dB | audio SNR dB | decoder on fp32 latents dB |",
        "|---|---|---|---|---|---|",
    ]
    for name, dtype in VARIANTS.items():
        model = moved(ref, "cpu", dtype)
        lat, audio = generate(model, args.patches)
        dec = decode(model, lat_ref)
        cells = [snr_db(prompt_ref, encode(model, clip)), snr_db(lat_ref[:4], lat[:4]), snr_db(lat_ref, lat),
                 snr_db(audio_ref, audio), snr_db(decode(ref, lat_ref), dec)]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print(f"{args.preset} preset, random weights, {args.patches} patches after a typical prompt, CPU, "
          f"torch {torch.__version__}; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
