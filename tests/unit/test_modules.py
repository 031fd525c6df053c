"""Shape contracts of each module, and cached decoding equal to full recomputation."""

from __future__ import annotations

import torch

from engine.config import PRESETS, Qwen3Config
from engine.layers.qwen3 import Qwen3Stack
from engine.models.core import FireRedTTS3Core, cosine_schedule
from engine.models.dit import DiT
from engine.models.patch_encoder import PatchEncoder
from engine.models.redae import RedAEDecoder, RedAEEncoder
from tests.slot_cache import SlotCache

TINY = PRESETS["tiny"]


def test_qwen3_shapes_and_window():
    torch.manual_seed(0)
    cfg = Qwen3Config(32, 64, 2, 4, 2, head_dim=8, sliding_window=4)
    stack = Qwen3Stack(cfg).eval()
    x = torch.randn(2, 10, 32)
    y = stack(x)
    assert y.shape == (2, 10, 32)
    # with a window of 4, output 9 must not depend on input 0..5 after 2 layers? (receptive field 2*3=6)
    x2 = x.clone()
    x2[:, 0:3] += 1.0
    y2 = stack(x2)
    assert torch.allclose(y[:, 9], y2[:, 9], atol=1e-6)  # inputs 0..2 are out of 9's receptive field (9-6=3)
    assert not torch.allclose(y[:, 5], y2[:, 5], atol=1e-4)


def test_patch_encoder_and_dit_shapes():
    c = TINY.core
    pe = PatchEncoder(64, 48, 4, c.patch_encoder_hidden_size, 1, 4, 2).eval()
    assert pe(torch.randn(2, 12, 64)).shape == (2, 3, 48)
    dit = DiT(64 + 32 + 16, 64, 32, 2, 4, 2).eval()
    assert dit(torch.randn(6, 12, 112), torch.rand(6)).shape == (6, 12, 64)


def test_redae_shapes():
    enc, dec = RedAEEncoder(TINY.redae).eval(), RedAEDecoder(TINY.redae).eval()
    with torch.no_grad():
        lat = enc(torch.randn(1, 3840 * 2))
        assert lat.shape == (1, 8, 64)
        assert dec(lat).shape == (1, 8 * 960)


def test_flow_shapes_and_schedule():
    torch.manual_seed(0)
    core = FireRedTTS3Core(TINY.core).eval()
    ts = cosine_schedule(10)
    assert ts[0] == 0 and abs(float(ts[-1]) - 1) < 1e-6 and bool((ts[1:] > ts[:-1]).all())
    with torch.no_grad():
        out = core.flow(
            torch.randn(3, 8, 64), torch.randn(3, 3, 64), torch.randn(3, 512), torch.randn(3, 4, 64), ts,
            torch.tensor([2.0, 0.0, 1.0]),
        )  # fmt: skip
    assert out.shape == (3, 4, 64)


@torch.no_grad()
def test_backbone_cached_decode_equals_full_recompute():
    torch.manual_seed(0)
    cfg = TINY.core.backbone
    stack = Qwen3Stack(cfg, with_embeddings=True).eval()
    full_in = torch.randn(1, 12, cfg.hidden_size)
    full = stack(full_in)
    cache = SlotCache(cfg, slots=3, max_len=32, device="cpu", dtype=torch.float32)
    view = cache.batch([2], [0], 8)
    outs = [stack(full_in[:, :8], positions=view.positions, cache=view, mask=view.mask())]
    for t in range(8, 12):
        v = cache.batch([2], [t], 1)
        outs.append(stack(full_in[:, t : t + 1], positions=v.positions, cache=v, mask=v.mask()))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_backbone_batched_decode_equals_solo():
    """Rows of different lengths decoded together match each row decoded alone."""
    torch.manual_seed(0)
    cfg = TINY.core.backbone
    stack = Qwen3Stack(cfg).eval()
    lens = [5, 9, 3]
    seqs = [torch.randn(1, n + 1, cfg.hidden_size) for n in lens]
    solo = [stack(s)[:, -1] for s in seqs]
    cache = SlotCache(cfg, slots=4, max_len=16, device="cpu", dtype=torch.float32)
    slots = [3, 0, 1]
    for s, slot, n in zip(seqs, slots, lens):
        v = cache.batch([slot], [0], n)
        stack(s[:, :n], positions=v.positions, cache=v, mask=v.mask())
    v = cache.batch(slots, lens, 1)
    batched = stack(torch.cat([s[:, -1:] for s in seqs]), positions=v.positions, cache=v, mask=v.mask())
    for i in range(3):
        torch.testing.assert_close(batched[i, -1], solo[i][0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_redae_streaming_decode_equals_full_decode():
    torch.manual_seed(0)
    dec = RedAEDecoder(TINY.redae).eval()
    lat = torch.randn(1, 45, 64)  # 90 frames: longer than the 64-frame window
    full = dec(lat)
    stream = dec.stream(1)
    parts = [stream.decode(lat[:, a:b]) for a, b in ((0, 12), (12, 13), (13, 40), (40, 45))]
    parts.append(stream.finish())
    out = torch.cat(parts, dim=1)
    assert out.shape == full.shape == (1, 45 * 960)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-4)
    # the window bounds the cache
    assert stream.cache.k[0].shape[2] == TINY.redae.dec_sliding_window - 1
