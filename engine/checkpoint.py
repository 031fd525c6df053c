"""Checkpoints in the official FireRedTTS3 folder layout, loaded into the model's modules.

Layout (Hugging Face ``save_pretrained`` folders, as published)::

    DIR/fireredtts3_base/{config.json, model.safetensors | model.safetensors.index.json + shards}
    DIR/fireredtts3_instruct/{config.json, model.safetensors ...}   FireRedTTS3-Instruct (no CAM++)
    DIR/redae/{config.json, model.safetensors ...}
    DIR/campp/campplus_voxceleb.bin        plain state dict, read with torch.load(weights_only=True)
    DIR/text_tokenizer/{tokenizer.json, tokenizer_config.json, vocab.json, merges.txt}

A folder may hold either core or both; Base needs CAM++, Instruct does not.

:mod:`engine.random_checkpoint` writes the same layout with random weights; they load the same way.
``python -m engine.checkpoint DIR`` loads a checkpoint and prints its parameter counts.
Past 300 lines on purpose: each check of the official layout sits next to the loading it guards (names,
shapes, dtypes, the precision policy), and the CLI prints what was loaded.
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
INSTRUCT_DIR = "fireredtts3_instruct"
MODELS = ("base", "instruct")  # the cores a checkpoint may hold
CORE_DIRS = {"base": CORE_DIR, "instruct": INSTRUCT_DIR}
# Hugging Face may save a tied LM head's copy; the loader drops it when it equals the embedding.
TIED_LM_HEAD = "backbone_llm.lm_head.weight"

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
    core: FireRedTTS3Core | None  # Base; None when the folder lacks it or it was not asked for
    redae: RedAE
    campp: SpeakerEncoder | None  # None when not loaded
    tokenizer: TextTokenizer
    identity: str  # content identity of the checkpoint (configs + tensor headers)
    path: Path
    instruct: FireRedTTS3Core | None = None  # Instruct; None as for ``core``

    @property
    def cores(self) -> dict[str, FireRedTTS3Core]:
        """The loaded cores by name ("base", "instruct")."""
        return {k: v for k, v in (("base", self.core), ("instruct", self.instruct)) if v is not None}


def available_models(path: str | Path) -> tuple[str, ...]:
    """The cores a checkpoint folder holds, in :data:`MODELS` order."""
    return tuple(m for m in MODELS if (Path(path) / CORE_DIRS[m] / "config.json").is_file())


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
    models: tuple[str, ...] | None = None,
) -> Models:
    """Load a checkpoint folder. ``dtype`` None follows :func:`precision_policy` (float32 on CPU; on CUDA
    bfloat16 for the backbone and the RedAE encoder, float32 for the rest); a dtype applies to all.

    ``parts`` picks the networks to materialise (each Triton model needs only its own: the generator
    the cores, the prompt encoder the RedAE encoder and CAM++, the vocoder the RedAE decoder); the others
    stay on the meta device and take no memory. The tokenizer and configs are always read. ``models``
    picks the cores ("base", "instruct"; None: those the folder holds); CAM++ belongs to Base.

    Raises:
        FileNotFoundError: the folder, a shared part, or an asked-for core's folder is missing.
        CheckpointError: a core or RedAE does not match the model.
    """
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {root}")
    held = available_models(root)
    if models is None:
        models = held
        if not models:
            raise FileNotFoundError(
                f"checkpoint {root} holds no model: neither {CORE_DIR}/ nor {INSTRUCT_DIR}/ "
                "(expected the official FireRedTTS3 layout)"
            )
    unknown = set(models) - set(MODELS)
    if unknown or not models:
        raise ValueError(f"unknown models {sorted(unknown) or '(none)'}; choose from {MODELS}")
    for m in models:
        if m not in held:
            raise FileNotFoundError(f"checkpoint {root} lacks {CORE_DIRS[m]}/, so the {m} model cannot be loaded")
    device = torch.device(device)
    policy = precision_policy(device, dtype)
    needed = [REDAE_DIR, TOKENIZER_DIR] + ([CAMPP_FILE] if "base" in models else [])
    for part in needed:
        if not (root / part).exists():
            raise FileNotFoundError(f"checkpoint {root} lacks {part} (expected the official FireRedTTS3 layout)")
    cores = {m: _load_core(root, m, "core" in parts, device, policy) for m in models}
    redae = _load_redae(root, parts, device, policy)
    load_campp_now = "campp" in parts and "base" in models
    campp = load_campp(root / CAMPP_FILE, device=device, dtype=torch.float32) if load_campp_now else None
    tokenizer = TextTokenizer.from_dir(root / TOKENIZER_DIR)
    shapes = {m: c.cfg.backbone for m, c in cores.items()}
    for m, bb in shapes.items():
        if tokenizer.vocab_size > bb.vocab_size:
            raise CheckpointError(
                f"tokenizer has {tokenizer.vocab_size} ids but the {m} backbone embeds only {bb.vocab_size}"
            )
    return Models(cores.get("base"), redae, campp, tokenizer, _identity(root), root, cores.get("instruct"))


def _load_core(root: Path, model: str, materialise: bool, device, policy) -> FireRedTTS3Core:
    folder = root / CORE_DIRS[model]
    with torch.device("meta"):
        core = FireRedTTS3Core(load_core_config(folder, instruct=model == "instruct"))
    if materialise:

        def core_dtype(name: str) -> torch.dtype:
            return policy["backbone"] if name.startswith("backbone_llm.") else policy["core"]

        state = read_safetensors(folder)
        if model == "instruct" and TIED_LM_HEAD in state:
            head, embed = state.pop(TIED_LM_HEAD), state.get("backbone_llm.model.embed_tokens.weight")
            if embed is None or head.shape != embed.shape or not torch.equal(head, embed):
                raise CheckpointError(f"{folder}: {TIED_LM_HEAD} differs from the token embedding (untied heads "
                                      "are not supported: the model ties them)")  # fmt: skip
        load_into(core, state, str(folder), device, core_dtype)
    return core


def _load_redae(root: Path, parts: tuple[str, ...], device, policy) -> RedAE:
    with torch.device("meta"):
        redae = RedAE(load_redae_config(root / REDAE_DIR))
    if "encoder" in parts or "decoder" in parts:
        state = check_state(redae, read_safetensors(root / REDAE_DIR), str(root / REDAE_DIR))
        for sub in ("encoder", "decoder"):
            if sub in parts:
                own = {k[len(sub) + 1 :]: v for k, v in state.items() if k.startswith(sub + ".")}
                assign(getattr(redae, sub), own, device, policy[sub])
    return redae


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(path: str | Path) -> str:
    m = load_models(path)
    parts = {f"{name} core": count_parameters(core) for name, core in m.cores.items()}
    parts |= {"redae encoder": count_parameters(m.redae.encoder), "redae decoder": count_parameters(m.redae.decoder)}
    if m.campp is not None:
        parts["campp"] = count_parameters(m.campp)
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
