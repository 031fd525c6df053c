"""Per-network dtypes: the reference's policy on CUDA, float32 on CPU, overrides, and a mixed run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.checkpoint import precision_policy
from engine.fireredtts3 import FireRedTTS3
from engine.params import GenerationParams
from engine.synthesize import synthesize

BF16, FP32 = torch.bfloat16, torch.float32


def test_policy_follows_the_reference_on_cuda_and_is_float32_on_cpu():
    assert precision_policy("cuda") == {"backbone": BF16, "core": FP32, "encoder": BF16, "decoder": FP32}
    assert precision_policy("cuda:1")["backbone"] == BF16
    assert set(precision_policy("cpu").values()) == {FP32}
    assert set(precision_policy("cuda", torch.float16).values()) == {torch.float16}  # one dtype for all
    assert precision_policy("cuda", {"decoder": BF16})["decoder"] == BF16
    with pytest.raises(ValueError, match="unknown networks"):
        precision_policy("cpu", {"dit": BF16})


def test_mixed_precision_loads_each_network_in_its_dtype_and_speaks(tiny_ckpt, model):
    """The CUDA policy's split, run on CPU: bfloat16 backbone and encoder beside float32 heads, flow and
    decoder; the casts at their borders let the whole pipeline run and stay close to float32."""
    mixed = FireRedTTS3.from_checkpoint(tiny_ckpt, "cpu", dtype={"backbone": BF16, "encoder": BF16})
    core = mixed.core
    assert core.backbone_llm.layers[0].self_attn.q_proj.weight.dtype == BF16
    assert core.backbone_llm.embed_tokens.weight.dtype == BF16
    for m in (
        core.patch_encoder,
        core.dit,
        core.dit_head,
        core.stop_head,
        core.spk_proj_llm,
        mixed.models.redae.decoder,
    ):
        assert {p.dtype for p in m.parameters()} == {FP32}
    assert {p.dtype for p in mixed.models.redae.encoder.parameters()} == {BF16}
    gen = mixed.generator(1, 256, attention="sdpa")
    assert gen.cache.k.dtype == BF16 and gen.dtype == FP32

    params = GenerationParams(seed=3, min_patches=8, max_patches=8)
    got = synthesize(mixed, "Mixed precision", params=params)
    want = synthesize(model, "Mixed precision", params=params)
    assert got.shape == want.shape and np.isfinite(got).all() and np.abs(got).max() > 0
    assert not np.array_equal(got, want)  # the backbone really ran in bfloat16
