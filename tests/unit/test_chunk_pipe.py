"""The packing of a generator pipe's responses (serving.stub.chunk_pipe), which both its ends share. The pipe
itself: tests/unit/test_generator_host.py (the generator's end), test_models_in_process.py (tts's)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.protocol import LATENT_DIM, STOP, Chunk
from serving import contract
from serving.stub.chunk_pipe import pack, unpack


def rows(n: int, start: float) -> np.ndarray:
    return (start + np.arange(n * LATENT_DIM, dtype=np.float32)).reshape(n, LATENT_DIM)


def test_pack_and_unpack_give_back_the_chunks():
    chunks = [
        Chunk(5, rows(3, 0), rows(8, 1000), seq=0, seal=2**64 - 1),
        Chunk(9, rows(0, 0), rows(0, 0), last=True, finish_reason="error: ü\ud800", seq=4, seal=7),
        Chunk(5, rows(0, 0), rows(0, 0), seq=1, text="a plan"),
        Chunk(5, rows(12, 5), rows(0, 0), last=True, finish_reason=STOP, seq=2),
    ]
    arrays = pack(chunks)
    assert {k: v.shape for k, v in arrays.items()} == {
        "PIPE_CHUNKS": (4, 6),
        "PIPE_LATENTS": (23, 64),
        "PIPE_TEXT": (4, 2),
    }
    got = unpack(lambda name: arrays[name][None])  # as a response carries them: a batch dimension of 1
    for a, b in zip(got, chunks, strict=True):
        assert (a.stream_id, a.last, a.finish_reason, a.seq, a.seal, a.text) == (b.stream_id, b.last, b.finish_reason,
                                                                               b.seq, b.seal, b.text)  # fmt: skip
        np.testing.assert_array_equal(a.latents, b.latents)
        np.testing.assert_array_equal(a.prompt_latents, b.prompt_latents)
    assert unpack(lambda name: pack([])[name]) == []


def test_unpack_refuses_what_pack_never_writes():
    good = pack([Chunk(5, rows(3, 0), rows(0, 0))])
    with pytest.raises(ValueError, match="lacks"):
        unpack(lambda name: None if name == "PIPE_TEXT" else good[name])
    for name, value, match in (
        ("PIPE_LATENTS", rows(4, 0), "latent rows"),  # one row more than the table counts
        ("PIPE_CHUNKS", good["PIPE_CHUNKS"][:, :5], "whole rows"),
        ("PIPE_TEXT", good["PIPE_TEXT"][:, :1], "PIPE_TEXT"),
    ):
        with pytest.raises(ValueError, match=match):
            unpack(lambda n, name=name, value=value: value if n == name else good[n])
    big = good["PIPE_CHUNKS"].copy()
    big[0, 3] = contract.MAX_CHUNK_LATENTS + 1
    with pytest.raises(ValueError, match="contract"):
        unpack(lambda n: big if n == "PIPE_CHUNKS" else good[n])
