"""Pieces of the server that run without Triton: configs, request parsing, stream services."""

from __future__ import annotations

import numpy as np
import pytest

from engine import contract as C
from engine.cancel import CancelBoard
from engine.frontdoor import build_request, parse_parameters
from engine.generator import GenerationParams
from engine.repository import SOURCE, ServeOptions, build, render
from engine.service import GeneratorService, VocoderService
from engine.synthesize import synthesize


def test_committed_configs_match_the_contract():
    for name, text in render(ServeOptions()).items():
        assert (SOURCE / name / "config.pbtxt").read_text() == text, f"run `python -m engine.repository` ({name})"


def test_rendered_repository_has_every_tensor(tmp_path):
    repo = build(tmp_path / "repo", ServeOptions(checkpoint="/ck", slots=3))
    gen = (repo / "generator" / "config.pbtxt").read_text()
    assert "max_candidate_sequences: 3" in gen and "iterative_sequence: true" in gen
    for spec in C.GENERATOR_INPUTS:
        assert f'name: "{spec.name}"' in gen
    tts = (repo / "tts" / "config.pbtxt").read_text()
    assert all(f'name: "{s.name}"' in tts for s in C.TTS_INPUTS + C.TTS_OUTPUTS)
    assert (repo / "tts" / "1" / "model.py").is_file()


def test_parse_parameters_defaults_and_errors():
    assert parse_parameters(None)["chunk_first"] == 3
    assert parse_parameters('{"steps": 4, "cfg": 1.5}')["steps"] == 4
    with pytest.raises(ValueError, match="unknown request parameters"):
        parse_parameters({"stepz": 3})
    with pytest.raises(ValueError, match="chunk_next"):
        parse_parameters({"chunk_next": 0})
    with pytest.raises(ValueError, match="cfg must be float"):
        parse_parameters({"cfg": "lots"})


def test_build_request_validation():
    r = build_request("Hi", None, None, None, None, None, None, None)
    assert r.language == "English" and r.params.seed == 1234 and r.schedule == (3, 12)
    cases = [
        (("", None, None, None, None, None, None, None), "TEXT"),
        (("Hi", "Klingon", None, None, None, None, None, None), "LANGUAGE"),
        (("Hi", None, np.zeros(10, np.float32), None, None, None, None, None), "REF_SAMPLE_RATE"),
        (("Hi", None, np.zeros(0, np.float32), 16000, None, None, None, None), "REF_AUDIO is empty"),
        (("Hi", None, None, None, "words", None, None, None), "REF_TEXT"),
        (("Hi", None, None, None, None, None, None, {"steps": 500}), "steps"),
    ]
    for args, needle in cases:
        with pytest.raises(ValueError, match=needle):
            build_request(*args)


def test_generator_service_chunks_and_frees(tts):
    svc = GeneratorService(tts, slots=2, max_len=512)
    prompt = tts.encode_prompt(None)
    params = GenerationParams(seed=5, min_patches=7, max_patches=7)
    svc.admit("a", tts.tokens("Chunks", "English", prompt), prompt, params, (2, 3))
    sizes, finished = [], False
    while not finished:
        em = svc.step(["a"])["a"]
        if em.latents is not None:
            sizes.append(len(em.latents))
        finished = em.finished
    assert sizes == [8, 12, 8]  # 2 patches, 3 patches, then the last 2 (4 latents per patch)
    assert em.reason == "length"
    assert svc.active == 0 and "a" not in svc.live


def test_generator_service_rejects_bad_input_without_leaking(tts):
    svc = GeneratorService(tts, slots=1, max_len=64)
    prompt = tts.encode_prompt(None)
    with pytest.raises(ValueError, match="cache positions"):
        svc.admit("x", tts.tokens("Too long " * 20, "English", prompt), prompt, GenerationParams(max_patches=400))
    assert svc.active == 0
    svc.admit("y", tts.tokens("ok", "English", prompt), prompt, GenerationParams(max_patches=6))
    assert svc.active == 1 and svc.drop("y") and svc.active == 0


def test_vocoder_service_equals_offline_and_frees(tts):
    params = GenerationParams(seed=9, min_patches=8, max_patches=8)
    prompt = tts.encode_prompt(None)
    gen = GeneratorService(tts, 1, 512)
    gen.admit(1, tts.tokens("Vocoder", "English", prompt), prompt, params, (3, 12))
    voc = VocoderService(tts, idle_seconds=60)
    parts, first = [], True
    while True:
        em = gen.step([1])[1]
        if em.latents is not None:
            parts.append(voc.process(7, em.latents, first, False, prompt.latents.numpy() if first else None))
            first = False
        if em.finished:
            break
    parts.append(voc.process(7, np.zeros((0, 64), np.float32), False, True, None))
    got = np.concatenate(parts)
    ref = synthesize(tts, "Vocoder", params=params)
    assert np.array_equal(got, ref)
    assert voc.active == 0
    with pytest.raises(ValueError, match="unknown"):
        voc.process(7, np.zeros((4, 64), np.float32), False, False, None)


def test_vocoder_reaps_idle_streams(tts):
    voc = VocoderService(tts, idle_seconds=0.0)
    voc.process(3, np.zeros((0, 64), np.float32), True, False, tts.encode_prompt(None).latents.numpy())
    assert voc.active == 1
    assert voc.reap() == [3] and voc.active == 0


def test_cancel_board(tmp_path):
    b = CancelBoard(tmp_path / "c")
    assert not b.is_marked(5)
    b.mark(5)
    assert b.is_marked(5)
    b.clear(5)
    b.clear(5)
    assert not b.is_marked(5)
    with pytest.raises(ValueError):
        b.mark("../etc")


def test_stop_head_reason(tts):
    svc = GeneratorService(tts, slots=1, max_len=600)
    prompt = tts.encode_prompt(None)
    svc.admit("s", tts.tokens("Stops by itself", "English", prompt), prompt, GenerationParams(seed=7), (3, 12))
    em = None
    while em is None or not em.finished:
        em = svc.step(["s"])["s"]
    assert em.reason == "stop"  # the tiny checkpoint's stop head fires within a few patches


def test_vocoder_reuses_primed_prompt_bit_exactly(tts):
    """A second stream with the same prompt starts from a copy of the primed state: same audio."""
    rng = np.random.default_rng(1)
    prompt = tts.encode_prompt((0.1 * rng.standard_normal(30000)).astype(np.float32), 16000, "p").latents.numpy()
    chunks = [rng.standard_normal((n, 64)).astype(np.float32) for n in (12, 48, 8)]

    def run(voc, owner):
        out = [voc.process(owner, chunks[0], True, False, prompt)]
        out += [voc.process(owner, c, False, False, None) for c in chunks[1:]]
        out.append(voc.process(owner, np.zeros((0, 64), np.float32), False, True, None))
        return np.concatenate(out)

    cold = run(VocoderService(tts, primed_cache=0), 1)
    voc = VocoderService(tts, primed_cache=4)
    first, second = run(voc, 1), run(voc, 2)
    assert voc.primed_hits == 1
    assert np.array_equal(first, cold) and np.array_equal(second, cold)


def test_vocoder_batches_streams_past_priming(tts):
    """Four streams with different prompts and positions: batched decoding matches one-by-one."""
    rng = np.random.default_rng(3)
    prompts = [tts.encode_prompt((0.1 * rng.standard_normal(n)).astype(np.float32), 16000, "").latents.numpy()
               for n in (16000, 30000, 9000, 40000)]  # fmt: skip
    chunks = [[rng.standard_normal((12, 64)).astype(np.float32) for _ in range(4)] for _ in prompts]
    solo, together = VocoderService(tts), VocoderService(tts)
    want = [[solo.process(o, c[0], True, False, p)] for o, (p, c) in enumerate(zip(prompts, chunks, strict=True))]
    got = [[together.process(o, c[0], True, False, p)] for o, (p, c) in enumerate(zip(prompts, chunks, strict=True))]
    for step in range(1, 4):
        end = step == 3
        for o in range(4):
            want[o].append(solo.process(o, chunks[o][step], False, end, None))
        outs = together.process_many([(o, chunks[o][step], False, end, None) for o in range(4)])
        for o in range(4):
            got[o].append(outs[o])
    assert together.batched_rows >= 8 and solo.batched_rows == 0
    for o in range(4):
        a, b = np.concatenate(want[o]), np.concatenate(got[o])
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert together.active == 0


def test_bad_chunk_schedule_does_not_leak_a_slot(tts):
    svc = GeneratorService(tts, slots=1, max_len=512)
    prompt = tts.encode_prompt(None)
    with pytest.raises(ValueError, match="chunk schedule"):
        svc.admit("a", tts.tokens("x", "English", prompt), prompt, GenerationParams(max_patches=6), (0, 12))
    assert svc.active == 0
    svc.admit("b", tts.tokens("x", "English", prompt), prompt, GenerationParams(max_patches=6), (3, 12))
    assert svc.active == 1
