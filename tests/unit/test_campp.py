import dataclasses

import numpy as np
import pytest
import torch

from engine.models.campp import (
    CamppConfig,
    SpeakerEncoder,
    load_campp,
    save_campp,
    speaker_embedding,
)

# Counted from 3D-Speaker's CAMPPlus(feat_dim=80, embedding_size=512) built on the meta device.
REFERENCE_PARAMS = 7_176_224
REFERENCE_STATE_ENTRIES = 937  # parameters + BatchNorm buffers (incl. num_batches_tracked)
REFERENCE_STATE_NUMEL = 7_259_162


def _prompt(seconds: float = 1.6, seed: int = 0) -> np.ndarray:
    n = int(24000 * seconds) // 3840 * 3840  # left-padded prompts are whole patches
    return (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(np.float32)


def _tiny(seed: int = 0) -> SpeakerEncoder:
    torch.manual_seed(seed)
    return SpeakerEncoder(CamppConfig.tiny())


@pytest.mark.parametrize("config", [CamppConfig(), CamppConfig.tiny()], ids=["full", "tiny"])
def test_embedding_shape(config):
    torch.manual_seed(0)
    emb = speaker_embedding(SpeakerEncoder(config), _prompt())
    assert emb.shape == (1, 512) and emb.dtype == torch.float32
    assert torch.isfinite(emb).all()


def test_batch_rows_are_independent():
    model = _tiny()
    feats = torch.randn(2, 120, 80)
    both = model(feats)
    torch.testing.assert_close(both[1:], model(feats[1:]))


def test_full_model_matches_reference_layout():
    with torch.device("meta"):
        model = SpeakerEncoder()
    assert sum(p.numel() for p in model.parameters()) == REFERENCE_PARAMS
    sd = model.state_dict()
    assert len(sd) == REFERENCE_STATE_ENTRIES
    assert sum(v.numel() for v in sd.values()) == REFERENCE_STATE_NUMEL
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["head.layer1.0.shortcut.0.weight"] == (32, 32, 1, 1)
    assert "head.layer1.1.shortcut.0.weight" not in shapes
    assert shapes["xvector.tdnn.linear.weight"] == (128, 320, 5)
    assert shapes["xvector.block2.tdnnd24.nonlinear1.batchnorm.running_mean"] == (256 + 23 * 32,)
    assert shapes["xvector.block3.tdnnd16.cam_layer.linear1.bias"] == (64,)
    assert shapes["xvector.transit3.linear.weight"] == (512, 1024, 1)
    assert shapes["xvector.out_nonlinear.batchnorm.weight"] == (512,)
    assert shapes["xvector.dense.linear.weight"] == (512, 1024, 1)
    assert "xvector.dense.nonlinear.batchnorm.weight" not in shapes  # affine=False
    assert "xvector.dense.nonlinear.batchnorm.running_var" in shapes
    assert CamppConfig.from_state_dict(sd) == CamppConfig()


def test_tiny_round_trip(tmp_path):
    model = _tiny()
    path = tmp_path / "campplus_voxceleb.bin"
    save_campp(model, path)
    loaded = load_campp(path)
    assert loaded.config == CamppConfig.tiny()
    assert not loaded.training
    prompt = _prompt()
    torch.testing.assert_close(speaker_embedding(loaded, prompt), speaker_embedding(model, prompt), rtol=0, atol=0)


def test_load_casts_dtype(tmp_path):
    path = tmp_path / "c.bin"
    save_campp(_tiny(), path)
    model = load_campp(path, "cpu", torch.bfloat16)
    assert model.head.conv1.weight.dtype == torch.bfloat16
    assert model.head.bn1.num_batches_tracked.dtype == torch.long
    assert speaker_embedding(model, _prompt()).dtype == torch.bfloat16


def test_mismatched_state_dict_names_bad_keys(tmp_path):
    sd = _tiny().state_dict()
    del sd["xvector.block2.tdnnd1.nonlinear1.batchnorm.running_var"]
    sd["xvector.block2.tdnnd1.extra.weight"] = torch.zeros(3)
    sd["xvector.transit1.linear.weight"] = torch.zeros(7, 7, 1)
    path = tmp_path / "bad.bin"
    torch.save(sd, path)
    with pytest.raises(ValueError) as err:
        load_campp(path)
    msg = str(err.value)
    for name in (
        "xvector.block2.tdnnd1.nonlinear1.batchnorm.running_var",
        "xvector.block2.tdnnd1.extra.weight",
        "xvector.transit1.linear.weight",
    ):
        assert name in msg


def test_not_a_campp_state_dict(tmp_path):
    path = tmp_path / "other.bin"
    torch.save({"weight": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match="head.conv1.weight"):
        load_campp(path)
    torch.save(torch.zeros(3), path)
    with pytest.raises(ValueError, match="plain state dict"):
        load_campp(path)
    with pytest.raises(FileNotFoundError):
        load_campp(tmp_path / "missing.bin")


class _Payload:
    """Unpickling this (without weights_only) would create a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loader_refuses_arbitrary_pickles(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    sd = _tiny().state_dict()
    sd["payload"] = _Payload(marker)
    torch.save(sd, path)
    with pytest.raises(ValueError, match="evil.bin"):
        load_campp(path)
    assert not marker.exists()


def test_config_validation_and_frozen():
    cfg = CamppConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.growth_rate = 4
    with pytest.raises(ValueError, match="multiple of 8"):
        CamppConfig(feat_dim=81)
    with pytest.raises(ValueError, match="equal"):
        CamppConfig(block_layers=(1, 1), kernel_sizes=(3,), dilations=(1,))
    with pytest.raises(ValueError, match="odd"):
        CamppConfig(kernel_sizes=(3, 4, 3))


def test_config_inference_for_other_shapes():
    cfg = CamppConfig(
        feat_dim=40,
        embedding_size=192,
        m_channels=4,
        init_channels=16,
        growth_rate=4,
        bn_size=2,
        block_layers=(1, 3),
        kernel_sizes=(5, 3),
        dilations=(1, 2),
    )
    with torch.device("meta"):
        sd = SpeakerEncoder(cfg).state_dict()
    assert CamppConfig.from_state_dict(sd) == cfg


def test_forward_rejects_bad_input():
    model = _tiny()
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(1, 50, 40))
    with pytest.raises(ValueError, match="3 fbank frames"):
        model(torch.zeros(1, 2, 80))
    assert model(torch.randn(1, 3, 80)).shape == (1, 512)
