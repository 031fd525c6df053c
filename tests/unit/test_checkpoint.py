"""Loading the official layout: readable errors, and the full preset's tensor layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CORE_DIR, REDAE_DIR, CheckpointError, RedAE, check_state, load_models
from engine.config import PRESETS, load_core_config, load_redae_config
from engine.models.core import FireRedTTS3Core
from engine.random_checkpoint import make_checkpoint


def _copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _edit(folder, fn):
    f = folder / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_same_seed_same_files(tmp_path):
    a, b = make_checkpoint("tiny", tmp_path / "a", seed=3), make_checkpoint("tiny", tmp_path / "b", seed=3)
    for f in sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_models(tmp_path / "nope")


def test_missing_part(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    shutil.rmtree(ck / "redae")
    with pytest.raises(FileNotFoundError, match="redae"):
        load_models(ck)


def test_missing_and_unexpected_tensor(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)

    def edit(state):
        state.pop("dit.final_layer.linear.bias")
        state["dit.extra.weight"] = torch.zeros(2)

    _edit(ck / "fireredtts3_base", edit)
    with pytest.raises(CheckpointError) as e:
        load_models(ck)
    msg = str(e.value)
    assert "missing: dit.final_layer.linear.bias (64,)" in msg
    assert "unexpected: dit.extra.weight (2,)" in msg


def test_wrong_shape_and_dtype(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)

    def edit(state):
        state["decoder.in_proj.weight"] = torch.zeros(3, 64)
        state["encoder.out_proj.bias"] = torch.zeros(64, dtype=torch.int32)

    _edit(ck / "redae", edit)
    with pytest.raises(CheckpointError) as e:
        load_models(ck)
    msg = str(e.value)
    assert "wrong shape: decoder.in_proj.weight expected (128, 64), found (3, 64)" in msg
    assert "wrong dtype: encoder.out_proj.bias" in msg and "int32" in msg


def test_official_extras_are_accepted(tiny_ckpt, tmp_path):
    """The published RedAE carries unused token embeddings and the iSTFT window; they load and are dropped."""
    ck = _copy(tiny_ckpt, tmp_path)

    def edit(state):
        for stack in ("encoder.qwen3", "encoder.downsample.qwen3", "decoder.qwen3"):
            state[f"{stack}.embed_tokens.weight"] = torch.zeros(10, 64)
        state["decoder.istft_head.istft.window"] = torch.hann_window(1920)

    _edit(ck / "redae", edit)
    m = load_models(ck)
    assert not any("embed_tokens" in k for k in m.redae.state_dict())


def test_bf16_checkpoint_loads_as_float32(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    _edit(ck / "fireredtts3_base", lambda s: s.update({k: v.bfloat16() for k, v in s.items()}))
    m = load_models(ck, dtype=torch.float32)
    assert m.core.stop_head.weight.dtype == torch.float32


def test_sharded_checkpoint(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path)
    folder = ck / "fireredtts3_base"
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / fname), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_models(ck, parts=("core",)).core.state_dict()
    assert set(names) <= set(loaded), sorted(set(names) - set(loaded))[:5]
    for name in names:  # every tensor of both shards, as the unsharded file had it
        torch.testing.assert_close(loaded[name], state[name].to(loaded[name].dtype), rtol=0, atol=0, msg=name)


def _expected_full_core() -> dict[str, tuple[int, ...]]:
    """The reference FireRedTTS3BaseCore layout at the released sizes, written out from its modules."""
    e: dict[str, tuple[int, ...]] = {
        "backbone_llm.embed_tokens.weight": (151936, 2048),
        "backbone_llm.norm.weight": (2048,),
    }
    for i in range(28):
        p = f"backbone_llm.layers.{i}."
        e |= {
            p + "self_attn.q_proj.weight": (2048, 2048), p + "self_attn.k_proj.weight": (1024, 2048),
            p + "self_attn.v_proj.weight": (1024, 2048), p + "self_attn.o_proj.weight": (2048, 2048),
            p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
            p + "mlp.gate_proj.weight": (6144, 2048), p + "mlp.up_proj.weight": (6144, 2048),
            p + "mlp.down_proj.weight": (2048, 6144), p + "input_layernorm.weight": (2048,),
            p + "post_attention_layernorm.weight": (2048,),
        }  # fmt: skip

    def linear(name, o, i):
        return {name + ".weight": (o, i), name + ".bias": (o,)}

    def attn(p, d):
        return (
            linear(p + "to_q", d, d)
            | linear(p + "to_k", d, d)
            | linear(p + "to_v", d, d)
            | linear(p + "to_out.0", d, d)
        )

    e |= linear("spk_proj_llm", 2048, 512) | linear("spk_proj_dit", 512, 512) | linear("dit_head", 1024, 2048)
    e |= linear("stop_head", 1, 2048)
    e |= {"patch_encoder.cls_tok": (1, 1, 1024)} | linear("patch_encoder.in_proj", 1024, 64)
    for i in range(8):
        p = f"patch_encoder.blocks.{i}."
        e |= {p + "norm1.weight": (1024,), p + "norm2.weight": (1024,)} | attn(p + "attn.", 1024)
        e |= linear(p + "mlp.ff.0.0", 4096, 1024) | linear(p + "mlp.ff.2", 1024, 4096)
    e |= {"patch_encoder.out_proj.norm_final.weight": (1024,)} | linear("patch_encoder.out_proj.linear", 2048, 1024)
    e |= linear("dit.in_proj", 1024, 64 + 1024 + 512)
    e |= linear("dit.t_embedder.time_mlp.0", 1024, 256) | linear("dit.t_embedder.time_mlp.2", 1024, 1024)
    for i in range(11):
        p = f"dit.blocks.{i}."
        e |= {p + f"norm{j}.weight": (1024,) for j in (1, 2, 3)} | attn(p + "attn.", 1024)
        e |= {p + "conv.block.0.weight": (1024, 1024, 3), p + "conv.block.0.bias": (1024,)}
        e |= {p + "conv.block.2.weight": (1024, 1024, 3), p + "conv.block.2.bias": (1024,)}
        e |= linear(p + "mlp.ff.0.0", 3072, 1024) | linear(p + "mlp.ff.2", 1024, 3072)
        e |= linear(p + "adaLN_modulation.1", 9 * 1024, 1024)
    e |= linear("dit.final_layer.adaLN_modulation.1", 2048, 1024) | linear("dit.final_layer.linear", 64, 1024)
    return e


def _expected_full_redae() -> dict[str, tuple[int, ...]]:
    def qwen(prefix, layers):
        d = {prefix + "norm.weight": (896,)}
        for i in range(layers):
            p = f"{prefix}layers.{i}."
            d |= {
                p + "self_attn.q_proj.weight": (1792, 896), p + "self_attn.k_proj.weight": (256, 896),
                p + "self_attn.v_proj.weight": (256, 896), p + "self_attn.o_proj.weight": (896, 1792),
                p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
                p + "mlp.gate_proj.weight": (3584, 896), p + "mlp.up_proj.weight": (3584, 896),
                p + "mlp.down_proj.weight": (896, 3584), p + "input_layernorm.weight": (896,),
                p + "post_attention_layernorm.weight": (896,),
            }  # fmt: skip
        return d

    e = {
        "encoder.in_proj.0.weight": (896, 480), "encoder.in_proj.0.bias": (896,),
        "encoder.in_proj.1.weight": (896, 896), "encoder.in_proj.1.bias": (896,),
        "encoder.downsample.cls_tok": (1, 1, 896), "encoder.out_proj.weight": (64, 896), "encoder.out_proj.bias": (64,),
        "decoder.in_proj.weight": (1792, 64), "decoder.in_proj.bias": (1792,),
        "decoder.istft_head.out.weight": (1922, 896), "decoder.istft_head.out.bias": (1922,),
    }  # fmt: skip
    return e | qwen("encoder.qwen3.", 18) | qwen("encoder.downsample.qwen3.", 4) | qwen("decoder.qwen3.", 18)


def test_full_preset_layout_on_meta_device():
    full = PRESETS["full"]
    with torch.device("meta"):
        core, redae = FireRedTTS3Core(full.core), RedAE(full.redae)
    got_core = {k: tuple(v.shape) for k, v in core.state_dict().items()}
    got_redae = {k: tuple(v.shape) for k, v in redae.state_dict().items()}
    assert all(v.is_meta for v in core.state_dict().values())
    assert got_core == _expected_full_core()
    assert got_redae == _expected_full_redae()
    n = sum(v.numel() for v in core.parameters())
    assert 1.9e9 < n < 2.2e9, n  # Qwen3-1.7B backbone (with its embedding) plus ~0.3 B of heads


def test_full_preset_written_and_read_back_on_meta_device(tmp_path):
    """bench/full_size.sh's layout at the released sizes, without data: each folder's config and shard index
    written from the meta device, read back by the loader's config readers into meta modules, whose tensors
    are exactly the index's and pass the loader's strict check."""
    from bench.full_size import networks, shard_names, shard_plan, write_index

    full = PRESETS["full"]
    cfgs = {CORE_DIR: (full.core.to_json(), load_core_config, FireRedTTS3Core, _expected_full_core()),
            REDAE_DIR: (full.redae.to_json(), load_redae_config, RedAE, _expected_full_redae())}  # fmt: skip
    sizes = {}
    for sub, build in networks(full).items():
        cfg, read, cls, expected = cfgs[sub]
        with torch.device("meta"):
            written = build()
        shards = shard_plan(written, int(2e9), torch.float32)
        write_index(tmp_path / sub, written, shards, torch.float32, cfg)
        with torch.device("meta"):
            back = cls(read(tmp_path / sub))
        state = back.state_dict()
        assert {k: tuple(v.shape) for k, v in state.items()} == expected
        index = json.loads((tmp_path / sub / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(state)
        assert sorted(set(index["weight_map"].values())) == shard_names(len(shards))
        assert all(sum(state[n].numel() * 4 for n in s) <= 2e9 for s in shards if len(s) > 1)
        sizes[sub] = index["metadata"]["total_size"]
        assert sizes[sub] == 4 * sum(v.numel() for v in state.values())
        check_state(back, {k: torch.empty(v.shape, device="meta") for k, v in written.state_dict().items()}, sub)
    assert 8.4e9 < sizes[CORE_DIR] < 8.6e9  # the published fireredtts3_base: 8.5 GB of float32
    assert 2.1e9 < sizes[REDAE_DIR] < 2.2e9  # the published redae/ is 3.8 GB with its 3 unused embeddings


def test_full_size_writer_round_trip_on_tiny(tmp_path):
    """bench/full_size.py's writer (shards written one at a time) gives a checkpoint the loader takes;
    the same seed, the same weights; norms keep their init."""
    from bench.full_size import write_checkpoint

    a = load_models(write_checkpoint(tmp_path / "a", "tiny", shard_gb=0.002))
    b = load_models(write_checkpoint(tmp_path / "b", "tiny", shard_gb=0.002))
    assert len(list((tmp_path / "a" / CORE_DIR).glob("model-*.safetensors"))) > 1
    assert a.instruct is None and a.campp is not None
    for x, y in zip(a.core.state_dict().values(), b.core.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.core.backbone_llm.norm.weight, torch.ones_like(a.core.backbone_llm.norm.weight))


def test_partial_load_keeps_other_parts_on_meta(tiny_ckpt):
    m = load_models(tiny_ckpt, parts=("decoder",))
    assert not any(p.is_meta for p in m.redae.decoder.parameters())
    assert all(p.is_meta for p in m.redae.encoder.parameters())
    assert all(p.is_meta for p in m.core.parameters())
    assert m.campp is None
    with pytest.raises(ValueError, match="unknown parts"):
        load_models(tiny_ckpt, parts=("vocoder",))
