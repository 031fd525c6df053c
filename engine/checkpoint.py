"""Checkpoints in the official FireRedTTS3 folder layout, loaded into the model's modules.

Layout (Hugging Face ``save_pretrained`` folders, as published)::

    DIR/fireredtts3_base/{config.json, model.safetensors | model.safetensors.index.json + shards}
    DIR/redae/{config.json, model.safetensors ...}
    DIR/campp/campplus_voxceleb.bin        plain state dict, read with torch.load(weights_only=True)
    DIR/text_tokenizer/{tokenizer.json, tokenizer_config.json, vocab.json, merges.txt}

:mod:`engine.random_checkpoint` writes the same layout with random weights; they load the same way.
``python -m engine.checkpoint DIR`` loads a checkpoint and prints its parameter counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import RedAEConfig, load_core_config, load_redae_config
from engine.models.campp import SpeakerEncoder, load_campp
from engine.models.core import FireRedTTS3Core
from engine.models.redae import RedAEDecoder, RedAEEncoder
from engine.text import TextTokenizer

CORE_DIR, REDAE_DIR, CAMPP_FILE, TOKENIZER_DIR = (
    "fireredtts3_base",
    "redae",
    "campp/campplus_voxceleb.bin",
    "text_tokenizer",
)

# Tensors present in the official files that inference never reads: each RedAE Qwen3 stack's token
# embedding (151936 x 896, ~0.5 GB in float32 for the three) and the iSTFT window buffer.
IGNORED_SUFFIXES = ("qwen3.embed_tokens.weight", "istft_head.istft.window")


class CheckpointError(ValueError):
    """A checkpoint folder that does not match the model; the message lists every problem."""


class RedAE(nn.Module):
    """Container whose parameter names match ``redae/model.safetensors`` (``encoder.*``, ``decoder.*``)."""

    def __init__(self, cfg: RedAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = RedAEEncoder(cfg)
        self.decoder = RedAEDecoder(cfg)


@dataclass
class Models:
    core: FireRedTTS3Core
    redae: RedAE
    campp: SpeakerEncoder | None  # None when not loaded
    tokenizer: TextTokenizer
    identity: str  # content identity of the checkpoint (configs + tensor headers)
    path: Path


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a ``save_pretrained`` folder (single file or sharded with an index)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        shards = json.loads(index.read_text())["weight_map"].values()
        files = [folder / f for f in sorted(set(shards))]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                state[name] = sf.get_tensor(name)
    return state


def check_state(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Compare ``state`` with ``module``'s tensors; return it without the known-unused extras.

    Raises:
        CheckpointError: listing every missing, unexpected, mis-shaped or wrongly typed tensor.
    """
    expected = module.state_dict()
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES) or k in expected}
    problems = []
    for name in sorted(expected.keys() - state.keys()):
        problems.append(f"missing: {name} {tuple(expected[name].shape)}")
    for name in sorted(state.keys() - expected.keys()):
        problems.append(f"unexpected: {name} {tuple(state[name].shape)}")
    for name in sorted(expected.keys() & state.keys()):
        want, got = expected[name], state[name]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"wrong shape: {name} expected {tuple(want.shape)}, found {tuple(got.shape)}")
        elif want.is_floating_point() != got.is_floating_point():
            kind = "float" if want.is_floating_point() else "integer"
            problems.append(f"wrong dtype: {name} expected a {kind} tensor, found {got.dtype}")
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CheckpointError(
            f"{where}: checkpoint does not match the model ({len(problems)} problems):\n  " + "\n  ".join(shown)
        )
    return state


def assign(module: nn.Module, state: dict[str, torch.Tensor], device, dtype) -> None:
    """Load a checked ``state`` into ``module`` (built on the meta device), floats cast to ``dtype``
    (a dtype, or a function of the tensor's name giving one)."""
    pick = dtype if callable(dtype) else (lambda _name: dtype)
    cast = {
        k: (v.to(device=device, dtype=pick(k)) if v.is_floating_point() else v.to(device)) for k, v in state.items()
    }
    module.load_state_dict(cast, strict=True, assign=True)
    module.eval().requires_grad_(False)


def load_into(module: nn.Module, state: dict[str, torch.Tensor], where: str, device, dtype) -> None:
    assign(module, check_state(module, state, where), device, dtype)


def _identity(root: Path) -> str:
    """Hash of the configs and every tensor file's name, size and safetensors header (no full read)."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        h.update(rel.encode() + str(f.stat().st_size).encode())
        if f.suffix in (".json", ".txt"):
            h.update(f.read_bytes())
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 1 << 24)))
        else:  # campp .bin: small, hash it whole
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


PARTS = ("core", "encoder", "decoder", "campp")

# Which dtype each network runs in. On CUDA the reference runs the backbone and the RedAE encoder under
# bfloat16 autocast, and the PatchEncoder, the DiT flow head, the small heads and projections, and the
# RedAE decoder in float32 (fireredtts3/llm/fireredtts3_base.py: ``_backbone_one_step`` and
# ``RedAE.encode`` are the autocast regions); CAM++ is always float32. On CPU everything is float32.
PRECISION_MODULES = ("backbone", "core", "encoder", "decoder")  # "core" = the core without its backbone


def precision_policy(
    device: str | torch.device, dtype: torch.dtype | dict[str, torch.dtype] | None = None
) -> dict[str, torch.dtype]:
    """Per-network dtypes: the reference's on CUDA, float32 elsewhere. ``dtype``: one dtype for every
    network, or a dict overriding some of them (keys from :data:`PRECISION_MODULES`). CAM++ stays float32."""
    if isinstance(dtype, torch.dtype):
        return dict.fromkeys(PRECISION_MODULES, dtype)
    if torch.device(device).type == "cuda":
        policy = {
            "backbone": torch.bfloat16,
            "core": torch.float32,
            "encoder": torch.bfloat16,
            "decoder": torch.float32,
        }
    else:
        policy = dict.fromkeys(PRECISION_MODULES, torch.float32)
    unknown = set(dtype or {}) - set(PRECISION_MODULES)
    if unknown:
        raise ValueError(f"unknown networks {sorted(unknown)} in dtype; choose from {PRECISION_MODULES}")
    return {**policy, **(dtype or {})}


def load_models(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    parts: tuple[str, ...] = PARTS,
) -> Models:
    """Load a checkpoint folder. ``dtype`` None follows :func:`precision_policy` (float32 on CPU; on CUDA
    bfloat16 for the backbone and the RedAE encoder, float32 for the rest); a dtype applies to all.

    ``parts`` picks the networks to materialise (each Triton model needs only its own: the generator
    the core, the prompt encoder the RedAE encoder and CAM++, the vocoder the RedAE decoder); the others
    stay on the meta device and take no memory. The tokenizer and configs are always read.
    """
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {root}")
    device = torch.device(device)
    policy = precision_policy(device, dtype)
    for part in (CORE_DIR, REDAE_DIR, CAMPP_FILE, TOKENIZER_DIR):
        if not (root / part).exists():
            raise FileNotFoundError(f"checkpoint {root} lacks {part} (expected the official FireRedTTS3 layout)")
    core_cfg, redae_cfg = load_core_config(root / CORE_DIR), load_redae_config(root / REDAE_DIR)
    with torch.device("meta"):
        core, redae = FireRedTTS3Core(core_cfg), RedAE(redae_cfg)
    if "core" in parts:

        def core_dtype(name: str) -> torch.dtype:
            return policy["backbone"] if name.startswith("backbone_llm.") else policy["core"]

        load_into(core, read_safetensors(root / CORE_DIR), str(root / CORE_DIR), device, core_dtype)
    if "encoder" in parts or "decoder" in parts:
        state = check_state(redae, read_safetensors(root / REDAE_DIR), str(root / REDAE_DIR))
        for sub in ("encoder", "decoder"):
            if sub in parts:
                own = {k[len(sub) + 1 :]: v for k, v in state.items() if k.startswith(sub + ".")}
                assign(getattr(redae, sub), own, device, policy[sub])
    campp = load_campp(root / CAMPP_FILE, device=device, dtype=torch.float32) if "campp" in parts else None
    tokenizer = TextTokenizer.from_dir(root / TOKENIZER_DIR)
    if tokenizer.vocab_size > core_cfg.backbone.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the backbone embeds only {core_cfg.backbone.vocab_size}"
        )
    return Models(core, redae, campp, tokenizer, _identity(root), root)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(path: str | Path) -> str:
    m = load_models(path)
    parts = {
        "backbone+heads": count_parameters(m.core),
        "redae encoder": count_parameters(m.redae.encoder),
        "redae decoder": count_parameters(m.redae.decoder),
        "campp": count_parameters(m.campp),
    }
    lines = [f"{k:>16}: {v / 1e6:9.3f} M" for k, v in parts.items()]
    lines.append(f"{'total':>16}: {sum(parts.values()) / 1e6:9.3f} M  (identity {m.identity})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.checkpoint", description="load a checkpoint and print parameter counts"
    )
    ap.add_argument("path", type=Path, help="folder in the official FireRedTTS3 layout")
    print(describe(ap.parse_args(argv).path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
