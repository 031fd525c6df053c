"""Model configuration: frozen dataclasses read from (and written to) the official folder layout.

The official checkpoint is a set of Hugging Face ``save_pretrained`` folders:

- ``fireredtts3_base/config.json``: the LLM-DiT core (patch encoder, DiT, heads). The backbone's Qwen3
  sizes are hard-coded in the reference (Qwen3-1.7B); our presets add them under ``backbone_llm_config``,
  which the reference ignores, and a folder without that key gets the Qwen3-1.7B values.
- ``redae/config.json``: the RedAE audio autoencoder. Its Qwen3 stacks keep the Hugging Face defaults
  for what the config does not name (head_dim 128, rope theta 1e4, rms eps 1e-6).

Sizes of the ``tiny``/``small``/``full`` presets live here and nowhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from engine.protocol import SAMPLE_RATE

# Fixed signal facts of FireRedTTS3 (not configurable in the reference either; SAMPLE_RATE is the protocol's).
FRAME_SAMPLES = 480  # one RedAE decoder frame (50 Hz)
SAMPLES_PER_LATENT = 960  # one 25 Hz latent
PATCH_SIZE = 4  # latents per patch (one autoregressive step)
PATCH_SAMPLES = PATCH_SIZE * SAMPLES_PER_LATENT  # 3840 samples = 160 ms
REDAE_SCALE = 0.4  # Instruct works on RedAE latents x this (its inputs, history and outputs); Base on RedAE's


@dataclass(frozen=True)
class Qwen3Config:
    """Sizes of one Qwen3 decoder stack (backbone or RedAE)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    vocab_size: int = 151_936  # RedAE stacks carry an unused embed_tokens of this size
    sliding_window: int | None = None  # keys visible to a query, itself included; None = full causal

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Qwen3Config.{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


QWEN3_1_7B = Qwen3Config(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_eps=1e-6,
    vocab_size=151_936,
)

# HF Qwen3Config key <-> our field, for the backbone block written into config.json.
_HF_QWEN3_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_eps",
    "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class CoreConfig:
    """``fireredtts3_base/config.json``: backbone, patch encoder, DiT flow head and small heads."""

    redae_dim: int = 64  # latent channels
    num_history_patches: int = 2  # clean patches the DiT sees before the noisy one
    spk_in_dim: int = 512  # CAM++ embedding size
    patch_size: int = PATCH_SIZE  # latents per patch (one AR step); only 4 is supported
    patch_encoder_hidden_size: int = 1024
    patch_encoder_mlp_ratio: int = 4
    patch_encoder_depth: int = 8
    patch_encoder_num_heads: int = 16
    dit_mlp_ratio: int = 3
    dit_depth: int = 11
    dit_num_heads: int = 16
    dit_hidden_size: int = 1024
    backbone: Qwen3Config = QWEN3_1_7B
    # False: Base (fireredtts3_base/: speaker projections, a Qwen3Model backbone); True: Instruct
    # (fireredtts3_instruct/: no speaker, a Qwen3ForCausalLM backbone whose tied LM head writes text).
    # Not a key of config.json: the folder says which (its ``architectures`` agrees).
    instruct: bool = False

    def __post_init__(self) -> None:
        if self.patch_size != PATCH_SIZE:
            raise ValueError(f"only patch_size {PATCH_SIZE} is supported, got {self.patch_size}")
        if self.patch_encoder_hidden_size % self.patch_encoder_num_heads:
            raise ValueError("patch_encoder_hidden_size must be a multiple of patch_encoder_num_heads")
        if self.dit_hidden_size % self.dit_num_heads:
            raise ValueError("dit_hidden_size must be a multiple of dit_num_heads")

    @property
    def speaker_dim(self) -> int:
        """Speaker channels the DiT sees: the CAM++ embedding for Base, none for Instruct."""
        return 0 if self.instruct else self.spk_in_dim

    def to_json(self) -> dict:
        """The keys of the reference's config class (Instruct's has no ``spk_in_dim``), plus ours."""
        skip = {"backbone", "instruct"} | ({"spk_in_dim"} if self.instruct else set())
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        d["backbone_llm_config"] = {hf: getattr(self.backbone, ours) for hf, ours in _HF_QWEN3_KEYS.items()}
        if self.instruct:
            d["backbone_llm_config"]["tie_word_embeddings"] = True
        d["architectures"] = ["FireRedTTS3InstructCore" if self.instruct else "FireRedTTS3BaseCore"]
        return d

    @classmethod
    def from_json(cls, d: dict, instruct: bool = False) -> CoreConfig:
        known = {f.name for f in fields(cls)} - {"backbone", "instruct"}
        kwargs = {k: v for k, v in d.items() if k in known} | {"instruct": instruct}
        backbone = QWEN3_1_7B
        if "backbone_llm_config" in d:
            bb = d["backbone_llm_config"]
            backbone = replace(QWEN3_1_7B, **{ours: bb[hf] for hf, ours in _HF_QWEN3_KEYS.items() if hf in bb})
        return cls(**kwargs, backbone=backbone)


@dataclass(frozen=True)
class RedAEConfig:
    """``redae/config.json``: the RedAE encoder (audio -> 25 Hz latents) and decoder (latents -> audio)."""

    audio_patch_size: int = FRAME_SAMPLES
    audio_sample_rate: int = SAMPLE_RATE
    enc_hidden_size: int = 896
    enc_intermediate_size: int = 3584
    enc_num_hidden_layers: int = 18
    enc_num_attention_heads: int = 14
    enc_num_key_value_heads: int = 2
    enc_sliding_window: int = 64
    enc_extra_downsample_rate: int = 2
    enc_downsample_num_hidden_layers: int = 4
    bottleneck_dim: int = 64
    dec_hidden_size: int = 896
    dec_intermediate_size: int = 3584
    dec_num_hidden_layers: int = 18
    dec_num_attention_heads: int = 14
    dec_num_key_value_heads: int = 2
    dec_sliding_window: int = 64

    def __post_init__(self) -> None:
        if self.audio_patch_size != FRAME_SAMPLES or self.audio_sample_rate != SAMPLE_RATE:
            raise ValueError(
                f"only {FRAME_SAMPLES}-sample frames at {SAMPLE_RATE} Hz are supported, "
                f"got {self.audio_patch_size} at {self.audio_sample_rate} Hz"
            )
        if self.enc_extra_downsample_rate != 2:
            raise ValueError("only enc_extra_downsample_rate == 2 (50 Hz -> 25 Hz) is supported")

    @property
    def encoder(self) -> Qwen3Config:
        return Qwen3Config(
            self.enc_hidden_size, self.enc_intermediate_size, self.enc_num_hidden_layers,
            self.enc_num_attention_heads, self.enc_num_key_value_heads, sliding_window=self.enc_sliding_window,
        )  # fmt: skip

    @property
    def downsample(self) -> Qwen3Config:
        return Qwen3Config(
            self.enc_hidden_size, self.enc_intermediate_size, self.enc_downsample_num_hidden_layers,
            self.enc_num_attention_heads, self.enc_num_key_value_heads,
        )  # fmt: skip

    @property
    def decoder(self) -> Qwen3Config:
        return Qwen3Config(
            self.dec_hidden_size, self.dec_intermediate_size, self.dec_num_hidden_layers,
            self.dec_num_attention_heads, self.dec_num_key_value_heads, sliding_window=self.dec_sliding_window,
        )  # fmt: skip

    def to_json(self) -> dict:
        d = asdict(self)
        d["model_type"] = "redae"
        d["architectures"] = ["RedAE"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> RedAEConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class CamppPreset:
    """CAM++ sizes used when a preset *writes* a checkpoint (loading infers them from tensor shapes)."""

    m_channels: int = 32
    init_channels: int = 128
    growth_rate: int = 32
    bn_size: int = 4
    block_layers: tuple[int, int, int] = (12, 24, 16)


@dataclass(frozen=True)
class Preset:
    """Everything needed to write a checkpoint with random weights."""

    name: str
    core: CoreConfig
    redae: RedAEConfig
    campp: CamppPreset = field(default_factory=CamppPreset)
    stop_bias: float = 0.0  # initial stop-head bias: sets how long random-weight utterances run
    init_std_scale: float = 1.0  # weights ~ N(0, scale / sqrt(fan_in))
    # Instruct's text phase on random weights: (embedding scale, every row's channel 0, <|eot|>'s channel
    # 0, the unused ids' offset on it), see engine.random_checkpoint.bias_text_end; None: untouched
    # (plans then run to the 200-token cap).
    text_end_bias: tuple[float, float, float, float] | None = None

    @property
    def instruct(self) -> CoreConfig:
        """The Instruct core of this preset: the same sizes, no speaker."""
        return replace(self.core, instruct=True)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        core=CoreConfig(
            patch_encoder_hidden_size=64, patch_encoder_mlp_ratio=2, patch_encoder_depth=1,
            patch_encoder_num_heads=4, dit_mlp_ratio=2, dit_depth=2, dit_num_heads=4, dit_hidden_size=64,
            backbone=Qwen3Config(64, 128, 2, 4, 2, head_dim=16, rope_theta=1_000_000.0),
        ),
        redae=RedAEConfig(
            enc_hidden_size=64, enc_intermediate_size=128, enc_num_hidden_layers=2, enc_num_attention_heads=2,
            enc_num_key_value_heads=1, enc_downsample_num_hidden_layers=1, dec_hidden_size=64,
            dec_intermediate_size=128, dec_num_hidden_layers=2, dec_num_attention_heads=2, dec_num_key_value_heads=1,
        ),
        campp=CamppPreset(m_channels=8, init_channels=32, growth_rate=8, bn_size=2, block_layers=(2, 2, 2)),
        stop_bias=0.0,
        text_end_bias=(0.1, 1.0, -1.5, 4.0),  # plans of 1-13 tokens with seed 0 (measured: see bias_text_end)
    ),
    "small": Preset(
        name="small",
        core=CoreConfig(
            patch_encoder_hidden_size=256, patch_encoder_mlp_ratio=2, patch_encoder_depth=2,
            patch_encoder_num_heads=4, dit_mlp_ratio=2, dit_depth=4, dit_num_heads=4, dit_hidden_size=256,
            backbone=Qwen3Config(512, 1536, 8, 8, 4, head_dim=64, rope_theta=1_000_000.0),
        ),
        redae=RedAEConfig(
            enc_hidden_size=256, enc_intermediate_size=768, enc_num_hidden_layers=4, enc_num_attention_heads=4,
            enc_num_key_value_heads=2, enc_downsample_num_hidden_layers=2, dec_hidden_size=256,
            dec_intermediate_size=768, dec_num_hidden_layers=6, dec_num_attention_heads=4, dec_num_key_value_heads=2,
        ),
        stop_bias=1.0,  # with this seed, utterances stop after ~1-4 s (random weights barely move the stop logit)
    ),
    "full": Preset(name="full", core=CoreConfig(), redae=RedAEConfig()),
}  # fmt: skip


def nostop(preset: str) -> Preset:
    """``preset`` with a stop head that never fires: every utterance runs exactly ``max_patches``, so
    tests and benchmarks choose lengths (and long streams exist to cancel)."""
    return replace(PRESETS[preset], name=f"{preset}-nostop", stop_bias=-30.0)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fireredtts3-triton`` (default ``~/.cache/...``): generated checkpoints, runs, voices."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fireredtts3-triton"


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"config not found: {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_core_config(folder: Path, instruct: bool = False) -> CoreConfig:
    return CoreConfig.from_json(read_json(Path(folder) / "config.json"), instruct)


def load_redae_config(folder: Path) -> RedAEConfig:
    return RedAEConfig.from_json(read_json(Path(folder) / "config.json"))
