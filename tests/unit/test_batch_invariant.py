"""Batch-invariant mode (issue 46, engine/invariant.py): a stream's latents are the same bits stepped alone
and stepped beside other streams that join and leave (a generator's batch), and a chunk's audio the same
bits decoded alone or with other streams' chunks (the vocoder's batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.generator import Generator
from engine.invariant import TILE, batch_invariant, install, tiled_linear
from engine.kv_cache import PagedCache
from engine.params import GenerationParams
from engine.protocol import LENGTH, Chunk
from engine.vocoder_service import VocoderService
from tests.generation import TEXTS, Planned


def test_a_tiled_product_row_is_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3 * TILE + 3, 192, generator=g), torch.randn(320, 192, generator=g), torch.randn(320)
    whole = tiled_linear(x, w, b)
    for m in (1, 2, 3, 5, TILE + 1):
        assert torch.equal(tiled_linear(x[:m], w, b), whole[:m]), m
        assert torch.equal(tiled_linear(x[-m:], w, b), whole[-m:]), m
    assert torch.allclose(whole, torch.nn.functional.linear(x, w, b), atol=1e-4)


def _watched(model, invariant: bool, joins: dict[int, int], instruct: bool = False) -> torch.Tensor:
    """Stream 0 stepped to its end while other streams join at the steps ``joins`` names (step -> count)
    -> its (patches, 4, 64) latents."""
    core = model.models.instruct if instruct else model.core
    gen = Generator(None if instruct else core, PagedCache(core.cfg.backbone, 8, 512, "cpu", torch.float32,
                    page_size=16), instruct=core if instruct else None, batch_invariant=invariant)  # fmt: skip
    planned, prompt = Planned(gen), model.encode_prompt(None)

    def start(text: str, seed: int, patches: int):
        params = GenerationParams(seed=seed, max_patches=patches, min_patches=patches)
        if instruct:
            given = model.instruct_input("design", "a calm voice, a little slow", text)
            s = gen.new_instruct_stream(len(streams), given, params)
        else:
            s = gen.new_stream(len(streams), model.tokens(text, "English", prompt), prompt, params)
        planned.admit(s)
        streams.append(s)

    streams: list = []
    start("The stream that is watched, alone or not.", 7, 14)
    out = []
    for step in range(400):
        for _ in range(joins.get(step, 0)):
            start(TEXTS[len(streams) % len(TEXTS)], 100 + len(streams), 4 + 3 * len(streams))
        live = [s for s in streams if not s.finished]
        if not live:
            break
        for s, r in zip(live, planned.step(live), strict=True):
            if s is streams[0] and r.latents is not None:
                out.append(r.latents)
    return torch.stack(out)


@pytest.mark.parametrize("instruct", [False, True], ids=["base", "instruct"])
def test_a_streams_latents_are_the_same_bits_alone_and_in_a_batch(model, instruct):
    joins = {0: 2, 2: 1, 3: 3, 7: 1}
    alone = _watched(model, True, {}, instruct)
    assert torch.equal(alone, _watched(model, True, joins, instruct))
    # the mode is what makes them equal: a plain batched step rounds by the batch's size
    assert not torch.equal(_watched(model, False, {}, instruct), _watched(model, False, joins, instruct))


def test_a_chunks_audio_is_the_same_bits_decoded_alone_and_with_others(model):
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(40, 64, generator=g).numpy() for _ in range(3)]
    prompt, none = np.zeros((16, 64), np.float32), np.zeros((0, 64), np.float32)

    def decode(ids):
        svc, out = VocoderService(model, batch_invariant=True), {i: [] for i in ids}
        for k in range(10):
            chunks = [Chunk(i, latents[i][4 * k : 4 * k + 4], none if k else prompt, k == 9, LENGTH if k == 9 else "",
                            k) for i in ids]  # fmt: skip
            for i, audio in zip(ids, svc.process_many(chunks), strict=True):
                out[i].append(audio)
        return np.concatenate(out[0]), svc.batched_rows

    (alone, _), (together, batched) = decode([0]), decode([0, 1, 2])
    assert batched > 0 and np.array_equal(alone, together)


def test_installed_layers_tile_only_inside_the_mode():
    layer = torch.nn.Linear(16, 8)
    install(layer)
    x = torch.randn(3, 16)
    with batch_invariant():
        inside = layer(x)
    assert torch.equal(inside, tiled_linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
