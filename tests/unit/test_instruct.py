"""FireRedTTS3-Instruct in the engine: its checkpoint folder, the text phase, mixed batches with Base,
cancellation, streamed against offline audio, and the edits' length limit (tiny preset, few patches)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CheckpointError, load_models
from engine.chunking import ChunkSchedule
from engine.config import SAMPLES_PER_LATENT
from engine.fireredtts3 import FireRedTTS3
from engine.generator_state import Phase
from engine.params import GenerationParams
from engine.protocol import CANCELLED
from engine.streams import GeneratorService
from engine.synthesize import instruct_run
from engine.vocoder_service import VocoderService
from tests.generation import Planned

SOS, EOT, IMAGE_PAD, VIDEO_PAD = 151669, 151677, 151655, 151656  # the real Qwen3 / FireRed ids
RATE = 24_000


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, int(seconds * RATE)).astype(np.float32)


def _params(task: str, patches: int = 8, seed: int | None = None) -> GenerationParams:
    cfg = 2.0 if task == "clone" else 1.2
    seed = (2 if task == "design" else 1234) if seed is None else seed
    return GenerationParams(seed=seed, cfg=cfg, max_patches=patches, min_patches=min(6, patches))


def _input(model: FireRedTTS3, task: str, seed: int = 0):
    if task == "design":
        return model.instruct_input("design", "a calm older man, a little slow", "Hello there.")
    latents = model.encode_latents(_noise(0.5 + 0.2 * seed, seed), RATE)
    instruction = {"clone": "", "semantic_edit": "delete the word at index 1.",
                   "acoustic_edit": "adjust the speed to 0.5x"}[task]  # fmt: skip
    return model.instruct_input(task, instruction, "Hello there.", latents, prompt_text="Hi.")


# -- the checkpoint ----------------------------------------------------------------------------------------
def test_the_instruct_folder_has_the_reference_names(tiny_ckpt):
    state = load_file(str(tiny_ckpt / "fireredtts3_instruct" / "model.safetensors"))
    assert state["backbone_llm.model.embed_tokens.weight"].shape == (151_936, 64)
    assert "backbone_llm.model.layers.1.mlp.down_proj.weight" in state and "backbone_llm.model.norm.weight" in state
    assert not any(k.startswith(("spk_proj", "backbone_llm.lm_head", "campp")) for k in state)
    # the DiT sees latents and the condition only: 64 + dit_hidden 64, no 512 speaker channels
    assert state["dit.in_proj.weight"].shape[1] == 64 + 64
    base = load_file(str(tiny_ckpt / "fireredtts3_base" / "model.safetensors"))
    assert base["dit.in_proj.weight"].shape[1] == 64 + 64 + 512
    assert base["backbone_llm.embed_tokens.weight"].shape == (151_936, 64)


def test_either_core_loads_alone(tiny_ckpt, tmp_path):
    both = load_models(tiny_ckpt)
    assert set(both.cores) == {"base", "instruct"} and both.campp is not None
    only_base = load_models(tiny_ckpt, models=("base",))
    assert only_base.instruct is None and only_base.core is not None
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    shutil.rmtree(ck / "fireredtts3_base")
    shutil.rmtree(ck / "campp")  # Instruct needs no CAM++
    alone = load_models(ck)
    assert alone.core is None and alone.campp is None and set(alone.cores) == {"instruct"}
    with pytest.raises(FileNotFoundError, match="lacks fireredtts3_base/"):
        load_models(ck, models=("base",))
    model = FireRedTTS3(alone, torch.device("cpu"), torch.float32)
    assert model.generator(1, 512).core is None


def test_the_checkpoint_command_shows_both_cores(tiny_ckpt):
    from engine.checkpoint import describe

    text = describe(tiny_ckpt)
    assert "base core" in text and "instruct core" in text and "campp" in text


def test_a_checkpoint_cached_by_an_older_layout_is_not_reused(tiny_ckpt, tmp_path):
    from engine.random_checkpoint import cached_checkpoint

    old = tmp_path / "tiny-seed0"
    shutil.copytree(tiny_ckpt, old)
    shutil.rmtree(old / "fireredtts3_instruct")  # what an older version cached there
    path = cached_checkpoint("tiny", old)
    assert path != old and path.name.startswith("tiny-seed0-layout")
    assert (path / "fireredtts3_instruct" / "config.json").is_file()
    assert cached_checkpoint("tiny", old) == path  # and reused from then on


def test_a_tied_lm_head_copy_is_accepted_and_an_untied_one_refused(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    file = ck / "fireredtts3_instruct" / "model.safetensors"
    state = load_file(str(file))
    state["backbone_llm.lm_head.weight"] = state["backbone_llm.model.embed_tokens.weight"].clone()
    save_file(state, str(file))
    assert load_models(ck, models=("instruct",)).instruct is not None
    state["backbone_llm.lm_head.weight"][0, 0] += 1.0
    save_file(state, str(file))
    with pytest.raises(CheckpointError, match="lm_head"):
        load_models(ck, models=("instruct",))


# -- the text phase ----------------------------------------------------------------------------------------
def test_chatml_placeholders_carry_the_latents(model):
    given = _input(model, "semantic_edit")
    assert given.tokens.count(IMAGE_PAD) == given.latents_in.shape[0] // 4 > 0 and VIDEO_PAD not in given.tokens
    clone = _input(model, "clone")
    assert clone.tokens.count(VIDEO_PAD) == clone.latents_out.shape[0] // 4 and clone.tokens[-1] == VIDEO_PAD


def test_a_text_phase_ends_and_hands_over_to_audio(model):
    gen = model.generator(1, 1024)
    given = _input(model, "design")
    s = gen.new_instruct_stream(0, given, _params("design"))
    planned = Planned(gen)
    planned.admit(s)
    assert s.phase is Phase.TEXT
    plan, steps = None, 0
    while s.phase is Phase.TEXT:
        r = planned.step([s])[0]
        steps += 1
        assert r.latents is None and not r.finished
        plan = r.text_ids if r.text_ids is not None else plan
    assert plan is not None and 1 <= len(plan) <= 12 and EOT not in plan
    # the prompt (in one step), every picked token (the plan, then <|eot|>) and <|sosp|> went through
    # the backbone ...
    assert s.position == len(given.tokens) + len(plan) + 1 + 1 and steps == 1 + len(plan) + 1 + 1
    # ... and the audio phase starts from <|sosp|> again, as the reference's loop does
    sos = model.models.instruct.backbone.embed_tokens.weight[SOS]
    assert torch.equal(s.next_input[0, 0], sos)
    latents = []
    while not s.finished:
        r = planned.step([s])[0]
        if r.latents is not None:
            latents.append(r.latents)
    assert 6 <= len(latents) <= 8 and s.text_ids == plan


def test_service_sends_the_plan_before_the_audio_and_never_to_the_vocoder(model):
    svc = GeneratorService(model, 1, 1024)
    svc.admit_instruct(9, _input(model, "design"), _params("design"), ChunkSchedule(2, 3, fixed=True))
    chunks = []
    while not (chunks and chunks[-1].last):
        chunk = svc.step([9])[9]
        if chunk is not None:
            chunks.append(chunk)
    assert chunks[0].plan and not any(c.plan for c in chunks[1:])
    assert chunks[1].seq == 0 and len(chunks[1].prompt_latents) == 0 and len(chunks[1].latents) == 2 * 4
    with pytest.raises(ValueError, match="plan"):
        VocoderService(model).process(chunks[0])
    assert svc.active == 0


# -- batching --------------------------------------------------------------------------------------------
def _drive(svc: GeneratorService, admit_at: dict[int, int], admit) -> tuple[dict[int, list], bool]:
    """Admit stream i at step admit_at[i], step every live stream each step until all end -> chunks per
    stream, and whether a step held text-phase and audio-phase streams together."""
    out, mixed, step = {i: [] for i in admit_at}, False, 0
    while step <= max(admit_at.values()) or svc.active:
        for sid, at in admit_at.items():
            if at == step:
                admit(svc, sid)
        counts = svc.phases()
        mixed |= counts[Phase.TEXT] > 0 and counts[Phase.AUDIO] > 0
        for sid, chunk in svc.step(list(svc.live)).items():
            if chunk is not None:
                out[sid].append(chunk)
        step += 1
    return out, mixed


def test_mixed_base_and_instruct_streams_equal_their_solo_runs(model):
    base = model.encode_prompt(None)
    jobs = {  # stream id -> (what, seed, admitted at step)
        1: ("base", 1, 0), 2: ("design", 2, 0), 3: ("semantic_edit", 0, 1), 4: ("base", 4, 2),
        5: ("design", 5, 3), 6: ("acoustic_edit", 1, 3), 7: ("clone", 2, 4), 8: ("base", 8, 5),
    }  # fmt: skip

    def admit(svc, sid):
        what, seed, _ = jobs[sid]
        if what == "base":
            svc.admit(sid, model.tokens(f"Stream number {sid}.", "English", base), base, _params("base", 7, seed),
                      ChunkSchedule(3, 4, fixed=True))  # fmt: skip
        else:
            svc.admit_instruct(sid, _input(model, what, seed), _params(what, 8, seed), ChunkSchedule(3, 4, fixed=True))

    def latents(chunks):
        return torch.from_numpy(np.concatenate([c.latents for c in chunks]))

    solo = {sid: _drive(GeneratorService(model, 1, 1024), {sid: 0}, admit)[0][sid] for sid in jobs}
    together = GeneratorService(model, 8, 1024)
    out, mixed = _drive(together, {sid: at for sid, (_, _, at) in jobs.items()}, admit)
    assert mixed  # some streams wrote their plans while others spoke
    for sid in jobs:
        got, want = out[sid], solo[sid]
        assert [c.text for c in got] == [c.text for c in want] and got[-1].finish_reason == want[-1].finish_reason
        assert [c.plan for c in got] == [c.plan for c in want] and got[0].plan == (
            jobs[sid][0] in ("design", "semantic_edit")
        )
        torch.testing.assert_close(latents(got), latents(want), atol=1e-4, rtol=1e-4)  # batch-size rounding
    assert together.active == 0 and together.scheduler.blocks.pages_in_use == 0


def test_phases_are_read_from_the_streams_and_change_only_when_a_plan_ends(model):
    svc, base = GeneratorService(model, 3, 1024), model.encode_prompt(None)
    svc.admit_instruct(1, _input(model, "design"), _params("design"))
    svc.admit(2, model.tokens("Spoken at once.", "English", base), base, _params("base"))
    assert svc.phases() == {Phase.AUDIO: 1, Phase.TEXT: 1}
    plan = None
    while plan is None:
        assert svc.live[1].state.phase is Phase.TEXT and svc.phases()[Phase.TEXT] == 1
        plan = next((c.text for c in [svc.step([1, 2]).get(1)] if c is not None and c.plan), None)
    while svc.live[1].state.phase is Phase.TEXT:  # the plan's last token, then <|sosp|>, are fed
        svc.step([1])
    assert svc.phases() == {Phase.AUDIO: 2, Phase.TEXT: 0}
    svc.drop(2)
    assert svc.phases() == {Phase.AUDIO: 1, Phase.TEXT: 0}


def test_a_stream_cancelled_in_its_text_phase_frees_its_slot_and_pages(model):
    svc = GeneratorService(model, 2, 1024)
    svc.admit_instruct(3, _input(model, "design"), _params("design"))
    svc.step([3])
    assert svc.live[3].state.phase is Phase.TEXT and svc.scheduler.blocks.pages_in_use > 0
    assert svc.cancel(3).finish_reason == CANCELLED
    assert svc.active == 0 and svc.scheduler.blocks.pages_in_use == 0 and sorted(svc.free) == [0, 1]


# -- offline ---------------------------------------------------------------------------------------------
def test_design_streamed_equals_offline_decoding(model):
    result = instruct_run(model, "design", "Hello there.", "a calm older man", max_patches=8)
    (latents,) = result.latents
    assert len(result.plan_token_ids[0]) >= 1 and result.chatml_token_ids[0][-1] == 151676  # <|sot|>
    whole = model.models.redae.decoder(torch.from_numpy(latents)[None])[0].numpy()  # no prompt: nothing to cut
    assert result.audio.shape == (latents.shape[0] * SAMPLES_PER_LATENT,)
    np.testing.assert_allclose(result.audio, whole, atol=1e-5)


def test_edits_refuse_an_overlong_recording(model):
    with pytest.raises(ValueError, match="recording is 31.0 s; an edit takes at most 30 s"):
        instruct_run(
            model, "acoustic_edit", instruction="adjust the speed to 0.5x", audio=_noise(31.0), sample_rate=RATE
        )
    long = torch.zeros(4 * 200, 64)  # 32 s of latents
    with pytest.raises(ValueError, match="at most 30 s"):
        model.instruct_input("semantic_edit", "delete the word at index 1.", latents=long)


@pytest.mark.parametrize("rate", [16_000, 24_000, 44_100])
def test_an_edit_of_exactly_30_s_is_taken(model, rate):
    """30 s is measured on the user's file (samples / rate): its latents, left-padded to whole patches (188
    for 30 s, 30.08 s), are no reason to refuse it (they were, as "recording is 30.1 s", after encoding)."""
    from serving.intake.requests import TTSInputs, parse_request

    audio = np.random.default_rng(3).uniform(-0.3, 0.3, 30 * rate).astype(np.float32)
    edit = dict(task="acoustic_edit", instruction="adjust the speed to 0.8x")
    assert parse_request(TTSInputs(None, None, audio, rate, "", "", **edit)).utterance.task
    latents = model.encode_latents(audio, rate)
    assert latents.shape[0] == 4 * 188
    assert model.instruct_input("acoustic_edit", "adjust the speed to 0.8x", latents=latents).tokens
    with pytest.raises(ValueError, match="30 s"):  # one sample more is over, at the front door
        parse_request(TTSInputs(None, None, np.append(audio, 0.0), rate, "", "", **edit))


@pytest.mark.parametrize(
    ("task", "instruction", "plans"),
    [("design", "a calm older man", 1), ("semantic_edit", "delete the word at index 1.", 1),
     ("acoustic_edit", "adjust the volume to 1.5", 0), ("clone", "", 0)],
)  # fmt: skip
def test_the_orchestrator_yields_one_plan_piece_before_the_audio(model, task, instruction, plans):
    import asyncio

    from engine.local import local_orchestrator
    from engine.orchestrator import Utterance
    from engine.prompt import VoicePrompt

    voice = None if task == "design" else VoicePrompt(model.encode_latents(_noise(0.6), RATE), torch.zeros(0), "Hi.")
    text = "" if task.endswith("edit") else "Hello there. And a second sentence here."
    utterance = Utterance(text, "English", _params(task, 6), split_tokens=4, task=task, instruction=instruction)

    async def pieces():
        return [p async for p in local_orchestrator(model).run(utterance, voice)]

    got = asyncio.run(pieces())
    kinds = ["plan" if p.text is not None else "audio" for p in got]
    assert kinds.count("plan") == plans and kinds[plans:] == ["audio"] * (len(got) - plans)
    assert all(p.audio.size == 0 for p in got[:plans]) and got[-1].final
    assert sum(p.audio.size for p in got) > 0


def test_an_acoustic_edit_outside_the_templates_is_refused(model):
    with pytest.raises(ValueError, match="speed"):
        instruct_run(model, "acoustic_edit", instruction="make it sound happier", audio=_noise(0.5), sample_rate=RATE)
