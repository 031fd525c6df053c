"""Synthetic math (engine.synthetic, benchmarks only): the same streams, chunks, pages and sample counts
as the real generator and vocoder, without their networks."""

from __future__ import annotations

import numpy as np
import pytest

from engine.block_manager import pages_for
from engine.chunking import ChunkSchedule
from engine.params import GenerationParams
from engine.streams import GeneratorService
from engine.synthetic import SyntheticFireRedTTS3, SyntheticVocoderService, ready_patch
from engine.vocoder_service import VocoderService
from serving.config.model_options import GeneratorOptions, VocoderOptions
from serving.config.options import ServeOptions
from tests.generation import check_disjoint

# (max_patches, chunk schedule) per stream; a stream joins every step. Fixed schedules: the two runs'
# chunks are compared, and the deadline rule's depend on the step times
STREAMS = [(7, ChunkSchedule(2, 3, True)), (5, ChunkSchedule(3, 12, True)), (13, ChunkSchedule(1, 4, True)),
           (6, ChunkSchedule(6, 6, True))]  # fmt: skip


def run(svc: GeneratorService, model, streams=STREAMS) -> dict[int, list]:
    """Each stream joins one step after the one before; all stepped together -> per stream its chunks."""
    prompt = model.encode_prompt(None)
    chunks: dict[int, list] = {i: [] for i in range(len(streams))}
    for step in range(100):
        if step < len(streams):
            patches, schedule = streams[step]
            # min_patches = max_patches: the real stop head cannot end a stream early
            params = GenerationParams(seed=step, min_patches=patches, max_patches=patches)
            svc.admit(step, model.tokens(f"stream {step}", "English", prompt), prompt, params, schedule)
        if not svc.live:
            break
        for i, c in svc.step(list(svc.live)).items():
            if c is not None:
                chunks[i].append(c)
        check_disjoint(svc.scheduler.blocks, svc.gen.cache)
    return chunks


def test_synthetic_streams_chunk_and_end_as_the_real_generator(model):
    real = run(GeneratorService(model, slots=4, max_len=512), model)
    synthetic_model = SyntheticFireRedTTS3(model)
    synthetic_svc = GeneratorService(synthetic_model, slots=4, max_len=512)
    synthetic = run(synthetic_svc, synthetic_model)
    shape = [[(len(c.latents), len(c.prompt_latents), c.last, c.finish_reason, c.seq) for c in cs]
             for cs in real.values()]  # fmt: skip
    assert [[(len(c.latents), len(c.prompt_latents), c.last, c.finish_reason, c.seq) for c in cs]
            for cs in synthetic.values()] == shape  # fmt: skip
    for (patches, _), cs in zip(STREAMS, synthetic.values(), strict=True):
        assert sum(len(c.latents) for c in cs) == 4 * patches
        assert all(np.array_equal(p, ready_patch().numpy()) for c in cs for p in c.latents.reshape(-1, 4, 64))
    assert synthetic_svc.active == 0 and synthetic_svc.scheduler.blocks.pages_in_use == 0
    assert sorted(synthetic_svc.free) == [0, 1, 2, 3]


def test_synthetic_generator_holds_pages_as_the_real_one(model):
    """After every step a live stream holds as many KV-cache pages as it would with the real model, and
    as many as the positions its generator state has written need."""
    held = {}
    for name, m in (("real", model), ("synthetic", SyntheticFireRedTTS3(model))):
        svc, prompt = GeneratorService(m, slots=2, max_len=512), m.encode_prompt(None)
        params = GenerationParams(seed=1, min_patches=40, max_patches=40)
        svc.admit(1, m.tokens("a text of a few tokens", "English", prompt), prompt, params)
        held[name] = []
        while svc.live:
            svc.step([1])
            if svc.live:
                assert svc.scheduler.blocks.pages_in_use == pages_for(svc.live[1].state.position, 16)
            held[name].append(svc.scheduler.blocks.pages_in_use)
    assert held["synthetic"] == held["real"] and max(held["real"]) > 1


def test_synthetic_vocoder_gives_as_many_samples_as_the_real_one(model):
    gen = GeneratorService(model, slots=4, max_len=512)
    chunks = [c for cs in run(gen, model).values() for c in cs]  # stream by stream, in order
    totals = {}
    for name, voc in (("real", VocoderService(model)), ("synthetic", SyntheticVocoderService(model))):
        out = [voc.process(c) for c in chunks]
        totals[name] = [sum(len(a) for a, c in zip(out, chunks, strict=True) if c.stream_id == i)
                        for i in range(len(STREAMS))]  # fmt: skip
        assert voc.active == 0
    assert totals["synthetic"] == totals["real"] == [3840 * p for p, _ in STREAMS]
    synthetic = SyntheticVocoderService(model)
    first = chunks[0]
    assert len(synthetic.process(first)) == len(first.latents) * 960
    with pytest.raises(ValueError, match="started twice"):
        synthetic.process(first)


def test_synthetic_math_is_off_unless_asked_for():
    off, on = ServeOptions(), ServeOptions(synthetic_math=True)
    assert not GeneratorOptions.of(off).synthetic_math and not VocoderOptions.of(off).synthetic_math
    assert GeneratorOptions.of(on).synthetic_math and VocoderOptions.of(on).synthetic_math


def test_step_cost_parses_presets_and_numbers_and_refuses_the_rest():
    from engine.step_cost import STEP_PRESETS, StepCost

    assert StepCost.parse("").free and StepCost.parse("0").free and str(StepCost.parse("")) == "free"
    assert StepCost.parse("80") == StepCost(80.0, 0.0)
    assert StepCost.parse(" 12+0.25 ") == StepCost(12.0, 0.25)
    assert StepCost.parse("H100") == STEP_PRESETS["h100"]
    assert StepCost(12, 0.25).seconds(200) == pytest.approx(0.062)
    for bad in ("fast", "-5", "1+2+3", "80ms", "20000"):
        with pytest.raises(ValueError, match="synthetic step|step cost"):
            StepCost.parse(bad)


def test_a_synthetic_step_lasts_its_cost_for_its_rows(model):
    """The step sleeps what its bookkeeping left of fixed + row x rows (an injected clock, not wall time)."""
    from engine.step_cost import StepCost

    synthetic_model = SyntheticFireRedTTS3(model, StepCost(40.0, 2.0))
    svc = GeneratorService(synthetic_model, slots=4, max_len=512)
    now, slept = [100.0], []
    svc.gen.clock = lambda: now[0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    svc.gen.sleep = sleep
    prompt = synthetic_model.encode_prompt(None)
    for i in range(3):
        params = GenerationParams(seed=i, min_patches=4, max_patches=4)
        svc.admit(
            i, synthetic_model.tokens(f"stream {i}", "English", prompt), prompt, params, ChunkSchedule(1, 4, True)
        )
    svc.step(list(svc.live))
    assert slept == [pytest.approx(0.046)]  # 40 ms + 3 rows x 2 ms, none of it used by the (frozen) clock
    svc.step([0])
    assert slept[-1] == pytest.approx(0.042)  # a step of one row


def test_synthetic_step_needs_synthetic_math_and_reaches_the_generator():
    with pytest.raises(ValueError, match="synthetic_step needs synthetic_math"):
        ServeOptions(synthetic_step="h100")
    with pytest.raises(ValueError, match="synthetic step must be"):
        ServeOptions(synthetic_math=True, synthetic_step="fast")
    assert GeneratorOptions.of(ServeOptions(synthetic_math=True, synthetic_step="12+0.25")).synthetic_step == "12+0.25"
