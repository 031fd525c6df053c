"""Offline synthesis on the tiny checkpoint: length, determinism, batching independence, CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.chunking import ChunkSchedule
from engine.local import local_orchestrator
from engine.orchestrator import Utterance
from engine.params import GenerationParams
from engine.synthesize import stream_audio, synthesize
from tests.generation import Planned
from tests.reference import reference_audio, reference_latents, reference_long


def _gen_latents(model, text, seed, prompt=None, max_patches=400):
    return reference_latents(model, text, GenerationParams(seed=seed, max_patches=max_patches), prompt).reshape(
        -1, 4, 64
    )


def test_length_is_whole_patches_and_deterministic(model):
    a = synthesize(model, "Hello", params=GenerationParams(seed=7))
    b = synthesize(model, "Hello", params=GenerationParams(seed=7))
    c = synthesize(model, "Hello", params=GenerationParams(seed=8))
    n_patches = _gen_latents(model, "Hello", 7).shape[0]
    assert a.dtype == np.float32 and a.ndim == 1
    assert len(a) == n_patches * 3840 and n_patches >= 6
    assert np.array_equal(a, b)
    assert not np.array_equal(a[: len(c)], c[: len(a)])
    assert np.isfinite(a).all() and np.abs(a).max() > 1e-4


def test_max_patches_limits_length(model):
    wav = synthesize(
        model,
        "A somewhat longer sentence for the limit.",
        params=GenerationParams(seed=1, min_patches=6, max_patches=7),
    )
    assert len(wav) <= 7 * 3840


def test_reference_voice_changes_output(model):
    rng = np.random.default_rng(0)
    ref = (0.1 * rng.standard_normal(16000 * 2)).astype(np.float32)
    a = synthesize(model, "Hello", ref_audio=ref, ref_sample_rate=16000, ref_text="hi", params=GenerationParams(seed=7))
    b = synthesize(model, "Hello", params=GenerationParams(seed=7))
    assert len(a) % 3840 == 0
    assert not np.array_equal(a[: len(b)], b[: len(a)])
    p = model.encode_prompt(ref, 16000, "hi")
    assert p.latents.shape == (4 * 13, 64)  # 2 s at 24 kHz -> 48000 samples -> padded to 13 patches
    assert p.speaker.shape == (512,)


def test_bad_inputs_raise(model):
    with pytest.raises(ValueError, match="Klingon"):
        synthesize(model, "Hello", language="Klingon")
    with pytest.raises(ValueError, match="non-empty"):
        model.encode_prompt(np.zeros(0, np.float32), 24000)
    with pytest.raises(ValueError, match="steps"):
        GenerationParams(steps=0)


def test_stream_chunks_follow_schedule_and_concatenate(model):
    params = GenerationParams(seed=3, min_patches=9, max_patches=9)
    chunks = list(stream_audio(model, "Hello world", params=params, schedule=ChunkSchedule(3, 4, fixed=True)))
    ref = reference_audio(model, "Hello world", params)  # whole-utterance decode, no streaming code
    got = np.concatenate(chunks)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # samples finished per chunk: 3 patches minus the iSTFT's open tail, then 4 patches, then the rest
    assert len(chunks) >= 3 and len(chunks[0]) == 3 * 3840 - 720


def test_chunking_changes_nothing_audible(model):
    params = GenerationParams(seed=5)
    a = synthesize(model, "Chunking test", params=params, schedule=ChunkSchedule(1, 1, fixed=True))
    b = synthesize(model, "Chunking test", params=params, schedule=ChunkSchedule(400, 400, fixed=True))
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=1e-5)


class SteppingClock:
    """A clock each reading of which is a seeded 20..300 ms later: irregular step times (r 0.1 to 1.9)."""

    def __init__(self, seed: int):
        self.rng, self.now = np.random.default_rng(seed), 0.0

    def __call__(self) -> float:
        self.now += float(self.rng.uniform(0.02, 0.3))
        return self.now


def test_irregular_chunks_stream_the_same_audio(model):
    """The deadline rule under uneven step times cuts chunks of many sizes; the stateful decoder makes the
    samples of one call over the whole utterance to float32 rounding (its attention runs over chunk-long
    blocks: not bit for bit), and the reference's whole-utterance decode."""
    params = GenerationParams(seed=6, min_patches=40, max_patches=40)
    orchestrator, chunks = local_orchestrator(model, clock=SteppingClock(0)), []
    orchestrator.generator.on_chunk = chunks.append

    async def pieces():
        return [piece.audio async for piece in orchestrator.run(Utterance("Irregular steps", params=params))]

    got = np.concatenate(asyncio.run(pieces()))
    patches = [len(c.latents) // 4 for c in chunks]
    assert sum(patches) == 40 and len(set(patches)) >= 3  # irregular indeed
    whole = synthesize(model, "Irregular steps", params=params, schedule=ChunkSchedule(400, 400, fixed=True))
    assert got.dtype == whole.dtype and got.shape == whole.shape
    assert np.abs(got - whole).max() < 1e-6  # measured: up to 1.2e-7 between chunkings
    np.testing.assert_allclose(got, reference_audio(model, "Irregular steps", params), atol=1e-5)


def test_batched_streams_equal_solo_runs(model):
    """Four streams stepped together (different texts, seeds, start times) match their solo runs."""
    texts = ["One", "Two words", "Three little words", "Four"]
    seeds = [1, 2, 3, 4]
    solo = [_gen_latents(model, t, s) for t, s in zip(texts, seeds)]
    prompt = model.encode_prompt(None)
    gen = model.generator(slots=4, max_len=512)
    planned = Planned(gen)
    streams, outs = [], [[] for _ in texts]
    for step in range(1000):
        if step < len(texts):  # a new stream joins at every step
            toks = model.tokens(texts[step], "English", prompt)
            streams.append(gen.new_stream(3 - step, toks, prompt, GenerationParams(seed=seeds[step])))
            planned.admit(streams[-1])
        live = [s for s in streams if not s.finished]
        if not live and len(streams) == len(texts):
            break
        for s, r in zip(live, planned.step(live)):
            if r.latents is not None:
                outs[streams.index(s)].append(r.latents)
    for i in range(len(texts)):
        got = torch.stack(outs[i])
        assert got.shape == solo[i].shape
        torch.testing.assert_close(got, solo[i], atol=1e-4, rtol=1e-4)


def test_cli_writes_identical_wavs(tiny_ckpt, tmp_path):
    def run(seed, name):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "engine.synthesize", "--checkpoint", str(tiny_ckpt), "--text", "Hello"]
        r = subprocess.run(cmd + ["--seed", str(seed), "--out", str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "RTF" in r.stderr
        return out

    with ThreadPoolExecutor(3) as pool:  # three processes side by side
        a, b, c = pool.map(run, (7, 7, 8), ("a.wav", "b.wav", "c.wav"))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    info = sf.info(str(a))
    assert info.samplerate == 24000 and info.channels == 1


def test_cli_normalizes_unless_told_not_to(tiny_ckpt, tmp_path):
    def run(flags):
        out = tmp_path / f"n{len(flags)}.wav"
        cmd = [sys.executable, "-m", "engine.synthesize", "--checkpoint", str(tiny_ckpt), "--text", "I have 3 apples."]
        r = subprocess.run(cmd + ["--max-patches", "6", "--out", str(out), *flags], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return out.read_bytes()

    with ThreadPoolExecutor(2) as pool:  # both processes side by side
        normalized, raw = pool.map(run, ((), ("--no-normalize",)))
    assert normalized != raw  # "three" and "3" are other tokens, so other audio


def test_cli_speed(tiny_ckpt, tmp_path):
    def run(flags):
        out = tmp_path / f"s{'-'.join(flags)}.wav"
        cmd = [sys.executable, "-m", "engine.synthesize", "--checkpoint", str(tiny_ckpt), "--text", "Faster"]
        return subprocess.run(cmd + ["--max-patches", "6", "--out", str(out), *flags], capture_output=True,
                              text=True), out  # fmt: skip

    with ThreadPoolExecutor(3) as pool:  # the three processes side by side
        (plain, a), (fast, b), (refused, _) = pool.map(run, ((), ("--speed", "2"), ("--speed", "5")))
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    assert sf.info(str(b)).frames == round(sf.info(str(a)).frames / 2)
    assert refused.returncode == 2 and "speed must be in 0.25..4.0" in refused.stderr


def test_text_command_shows_the_front_end():
    cmd = [sys.executable, "-m", "engine.frontend", "It costs $12.50. And 3 more?"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "language: English"
    assert "'It costs twelve point five dollars. And three more?'" in lines[1] and "tokens)" in lines[1]
    r = subprocess.run(
        [sys.executable, "-m", "engine.frontend", "--no-normalize", "\U0001f600"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "TEXT: nothing to speak after cleaning" in r.stderr


def test_cli_reports_bad_language(tiny_ckpt, tmp_path):
    cmd = [sys.executable, "-m", "engine.synthesize", "--checkpoint", str(tiny_ckpt), "--text", "x"]
    r = subprocess.run(cmd + ["--language", "Elvish", "--out", str(tmp_path / "x.wav")], capture_output=True, text=True)
    assert r.returncode != 0 and "Elvish" in r.stderr


LONG = (
    "The first sentence is here and it goes on for a while. The second one follows it closely. "
    "A third sentence arrives, talking about the weather and the sea. Finally the fourth ends it."
)


def test_long_text_is_split_and_cross_faded(model):
    from engine.frontend import prepare

    params = GenerationParams(seed=4, min_patches=6, max_patches=6)
    segs = prepare(LONG, None, lambda t: len(model.models.tokenizer.encode(t)), 40, max_patches=6).segments
    assert len(segs) >= 3
    whole = synthesize(model, LONG, params=params, split_tokens=40)
    assert len(whole) == len(segs) * 6 * 3840 - (len(segs) - 1) * 1200
    # independently: each segment decoded whole, joined by a 50 ms linear cross-fade
    np.testing.assert_allclose(whole, reference_long(model, LONG, params, 40), atol=1e-5)
    one = synthesize(model, LONG, params=params, split_tokens=0)
    assert len(one) == 6 * 3840  # unsplit: one segment, cut at max_patches
