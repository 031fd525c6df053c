"""Random-weight checkpoints in the official FireRedTTS3 layout (:mod:`engine.checkpoint` loads them).

``python -m engine.random_checkpoint --preset tiny DIR`` writes a preset's networks with random weights
from a fixed seed (and a small tokenizer with the same special tokens): same seed, same files. The
tests and the server's default run on such a checkpoint; the real weights load the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from engine.chatml import TEXT_EOT_ID
from engine.checkpoint import CAMPP_FILE, CORE_DIR, INSTRUCT_DIR, REDAE_DIR, TOKENIZER_DIR, RedAE
from engine.config import PRESETS, Preset
from engine.models.campp import CamppConfig, SpeakerEncoder, save_campp
from engine.models.core import FireRedTTS3Core
from engine.text import QWEN_FIRST_ID, write_tiny_tokenizer


@torch.no_grad()
def randomize(module: nn.Module, scale: float) -> None:
    """Fill ``module``'s weights in place from torch's global generator (seed it first for fixed weights).

    Linear and convolution weights are normal with std ``scale / sqrt(fan_in)`` (fan_in: the inputs of
    one output unit), their biases normal with std 0.02; embeddings standard normal. Other parameters
    (norms) keep their initial values. ``scale``: a preset's ``init_std_scale`` (1.0 for CAM++).
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            fan_in = m.weight[0].numel()
            m.weight.normal_(0.0, scale / math.sqrt(fan_in))
            if m.bias is not None:
                m.bias.normal_(0.0, 0.02)
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, 1.0)


@torch.no_grad()
def bias_text_end(core: FireRedTTS3Core, scale: float, every: float, eot: float, unused: float, words: int) -> None:
    """Make random weights end Instruct's text phase after a few tokens, written with the tokenizer's words.

    The LM head is the token embedding (tied). With standard-normal rows a token's own embedding runs
    through the residual stream to the last state and wins every step (the same token forever); rows
    scaled by ``scale`` leave the last state to the layers instead, whose channel 0 comes out about
    -1 on the tiny preset's weights. So channel 0 of every row is set to ``every`` and <|eot|>'s to
    ``eot``: <|eot|>'s score then moves with that channel, position by position, about as high as the
    best other scores. The ids the tiny tokenizer leaves unused (from ``words``, its learned vocabulary's
    size, up to Qwen's added tokens) get ``every + unused`` and so score lower: plans decode to text.
    Measured on the tiny preset (seed 0) with (0.1, 1.0, -1.5, 4.0): voice-design plans of 1-13 tokens
    (3 descriptions x 2 texts x 3 seeds), greedy semantic edits of 0-4 tokens (3 x 3 recordings).
    """
    weight = core.backbone.embed_tokens.weight
    weight.mul_(scale)
    weight[:, 0] = every
    weight[words:QWEN_FIRST_ID, 0] = every + unused
    weight[TEXT_EOT_ID, 0] = eot


def random_campp(p: Preset) -> SpeakerEncoder:
    """The preset's CAM++ speaker encoder with random weights."""
    c = p.campp
    campp = SpeakerEncoder(
        CamppConfig(
            feat_dim=80, embedding_size=p.core.spk_in_dim, m_channels=c.m_channels, init_channels=c.init_channels,
            growth_rate=c.growth_rate, bn_size=c.bn_size, block_layers=c.block_layers,
        )
    )  # fmt: skip
    randomize(campp, 1.0)
    return campp


def make_checkpoint(preset: str | Preset, out: str | Path, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of ``preset`` in the official layout; same seed, same files.

    Both cores are written (Base, then Instruct with the next random weights of the same generator).
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    root = Path(out)
    torch.manual_seed(seed)
    core, redae = FireRedTTS3Core(p.core), RedAE(p.redae)
    randomize(core, p.init_std_scale)
    randomize(redae, p.init_std_scale)
    with torch.no_grad():
        core.stop_head.bias.fill_(p.stop_bias)
    campp = random_campp(p)
    instruct = FireRedTTS3Core(p.instruct)
    randomize(instruct, p.init_std_scale)
    with torch.no_grad():
        instruct.stop_head.bias.fill_(p.stop_bias)
    vocab = write_tiny_tokenizer(root / TOKENIZER_DIR)
    if p.text_end_bias is not None:
        bias_text_end(instruct, *p.text_end_bias, _learned_words(root / TOKENIZER_DIR))
    written = ((CORE_DIR, core, p.core.to_json()), (INSTRUCT_DIR, instruct, p.instruct.to_json()),
               (REDAE_DIR, redae, p.redae.to_json()))  # fmt: skip
    for sub, model, cfg in written:
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if sub == REDAE_DIR:  # the published layout carries this buffer; the reference needs it to load
            tensors["decoder.istft_head.istft.window"] = torch.hann_window(4 * p.redae.audio_patch_size)
        save_file(tensors, str(root / sub / "model.safetensors"), metadata={"format": "pt"})
    (root / CAMPP_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_campp(campp, root / CAMPP_FILE)
    if vocab > p.core.backbone.vocab_size:
        raise ValueError(f"preset {p.name}: tokenizer ({vocab}) exceeds backbone vocab ({p.core.backbone.vocab_size})")
    return root


def _learned_words(folder: Path) -> int:
    """One past the largest id of the tiny tokenizer's learned vocabulary (below Qwen's added tokens)."""
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    return max(i for i in vocab.values() if i < QWEN_FIRST_ID) + 1


# Bumped whenever make_checkpoint writes different files for the same preset and seed; part of the
# cached checkpoint's folder name, so that a checkpoint cached by an older version is never reused.
# 2: the real Qwen3 token ids (backbone vocab 151,936) and the fireredtts3_instruct/ core.
LAYOUT_VERSION = 2


def cached_checkpoint(preset: str | Preset, path: str | Path, seed: int = 0) -> Path:
    """``path`` + ``-layout{LAYOUT_VERSION}`` holding ``preset``'s checkpoint (the folder returned),
    written on first use (atomically: a half-written checkpoint is never seen, and concurrent first uses
    leave one)."""
    path = Path(path)
    path = path.with_name(f"{path.name}-layout{LAYOUT_VERSION}")
    if (path / TOKENIZER_DIR / "tokenizer.json").is_file():
        return path
    name = preset if isinstance(preset, str) else preset.name
    print(f"creating the {name} checkpoint in {path} (first use) ...", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))  # same filesystem: the rename is atomic
    try:
        make_checkpoint(preset, tmp / "ck", seed=seed)
        if not path.exists():
            os.replace(tmp / "ck", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.random_checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    make_checkpoint(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} checkpoint to {args.out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
