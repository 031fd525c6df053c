"""Pieces of the server that run without Triton: configs, request parsing, stream services."""

from __future__ import annotations

import numpy as np
import pytest

from engine.chunking import ChunkSchedule
from engine.params import DEFAULT_SCHEDULE, GENERATION_PARAMETERS, GenerationParams, Parameter, parse_parameters
from engine.protocol import CANCELLED, Chunk, end_chunk
from engine.streams import GeneratorService
from engine.vocoder_service import VocoderService
from serving import contract
from serving.config.repository import SOURCE, ServeOptions, build, render
from serving.flow.side_channel import SideChannel
from serving.intake.requests import TTSInputs, parse_request
from tests.generation import run_to_end
from tests.reference import reference_audio

EMPTY = np.zeros((0, 64), np.float32)


def build_request(*inputs):
    """A ``tts`` request's (utterance, voice) from its inputs in :class:`TTSInputs`' order, as tts parses it."""
    speech = parse_request(TTSInputs(*inputs))
    return speech.utterance, speech.voice


def test_committed_configs_match_the_contract():
    for name, text in render(ServeOptions()).items():
        assert (SOURCE / name / "config.pbtxt").read_text() == text, (
            f"run `python -m serving.config.repository` ({name})"
        )


def test_rendered_repository_has_every_tensor(tmp_path):
    repo = build(tmp_path / "repo", ServeOptions(checkpoint="/ck", slots=3))
    gen = (repo / "generator" / "config.pbtxt").read_text()
    # one decoupled request per stream, stepped by the model's engine thread: no Triton batcher
    assert "decoupled: true" in gen and "sequence_batching" not in gen and "dynamic_batching" not in gen
    assert _param(gen, "slots") == "3"
    for spec in contract.GENERATOR_INPUTS + contract.GENERATOR_OUTPUTS:
        assert f'name: "{spec.name}"' in gen
    model = (repo / "tts" / "config.pbtxt").read_text()
    assert all(f'name: "{s.name}"' in model for s in contract.TTS_INPUTS + contract.TTS_OUTPUTS)
    assert (repo / "tts" / "1" / "model.py").is_file()
    ens = (repo / "tts_ensemble" / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in ens and (repo / "tts_ensemble" / "1").is_dir()
    assert 'model_name: "ensemble_generator"' in ens and 'model_name: "generator"' not in ens
    egen = (repo / "ensemble_generator" / "config.pbtxt").read_text()
    assert all(f'name: "{s.name}"' in egen for s in contract.GENERATOR_INPUTS + contract.GENERATOR_OUTPUTS)
    assert "decoupled: true" in egen and (repo / "ensemble_generator" / "1" / "model.py").is_file()
    # no Triton batcher in front of the vocoder: it drops chunks of a cancelled ensemble (its own engine batches)
    voc = (repo / "vocoder" / "config.pbtxt").read_text()
    assert "decoupled: true" in voc and "dynamic_batching" not in voc and "sequence_batching" not in voc


def test_voice_store_cap_reaches_the_prompt_encoder():
    text = render(ServeOptions(voice_store_max_gb=0.5))["prompt_encoder"]
    assert 'key: "voice_store_max_gb" value { string_value: "0.5" }' in text
    with pytest.raises(ValueError, match="voice_store_max_gb"):
        ServeOptions(voice_store_max_gb=0)


def _param(text: str, key: str) -> str | None:
    import re

    m = re.search(rf'key: "{key}" value {{ string_value: "([^"]*)" }}', text)
    return m.group(1) if m else None


def test_queue_bound_and_sealing_reach_the_models():
    models = render(ServeOptions(slots=3))
    assert _param(models["tts"], "slots") == "3" and _param(models["tts"], "max_queue") == "12"  # 4 x slots
    assert _param(render(ServeOptions(max_queue=0))["tts"], "max_queue") == "0"
    for name in ("tts", "ensemble_generator", "prompt_encoder"):  # one admission gate for every entry point
        assert (_param(models[name], "slots"), _param(models[name], "max_queue")) == ("3", "12"), name
    assert "max_queue_size: 30" in models["prompt_encoder"]  # 2 x (slots + queue): key-less work is bounded
    for name in ("prompt_encoder", "vocoder"):
        assert _param(models[name], "public_steps") == "1"  # the ensemble is served: key-less steps allowed
    assert _param(models["generator"], "public_steps") is None  # never: its callers are tts and ensemble_generator
    sealed = render(ServeOptions(ensemble=False))
    assert "tts_ensemble" not in sealed and "ensemble_generator" not in sealed
    for name in ("prompt_encoder", "vocoder"):
        assert _param(sealed[name], "public_steps") == "0"
    assert _param(models["vocoder"], "max_streams") == str(3 + 12 + 64)  # slots + queue + spare
    with pytest.raises(ValueError, match="max_queue"):
        ServeOptions(max_queue=-2)
    with pytest.raises(ValueError, match="slots must be in 1..1024"):
        ServeOptions(slots=1025)
    assert _param(render(ServeOptions(slots=1024))["generator"], "slots") == "1024"


def test_vocoder_refuses_new_streams_beyond_its_bound(model):
    voc = VocoderService(model, max_streams=2)
    prompt = model.encode_prompt(None).latents.numpy()
    voc.process(Chunk(3, EMPTY, prompt))
    voc.process(Chunk(5, EMPTY, prompt))
    with pytest.raises(RuntimeError, match="maximum of 2 streams"):
        voc.process(Chunk(7, EMPTY, prompt))
    assert voc.active == 2 and 7 not in voc.streams


def test_ensemble_wires_every_vocoder_input_from_the_generator():
    text = render(ServeOptions())["tts_ensemble"]
    for spec in contract.VOCODER_INPUTS:
        assert f'input_map {{ key: "{spec.name}" value: "_gen_{spec.name.lower()}" }}' in text
    # every generator output but the plan text (Instruct's, which the orchestrator keeps from the vocoder)
    assert {s.name for s in contract.VOCODER_INPUTS} == {s.name for s in contract.GENERATOR_OUTPUTS} - {"TEXT"}


def test_generator_settings_read_back_as_given():
    """One encoding of a stream's settings between the models (serving.contract): tts writes, the generator reads."""
    params = GenerationParams(seed=7, steps=4, cfg=1.25, max_patches=90, min_patches=6)
    seed, given = contract.encode_settings(params, ChunkSchedule(2, 9, fixed=True))
    assert seed == 7 and set(given) == {p.name for p in GENERATION_PARAMETERS}
    assert given == {
        "steps": 4,
        "cfg": "1.25",
        "max_patches": 90,
        "chunk_first": 2,
        "chunk_next": 9,
        "chunk_fixed": True,
    }
    assert contract.decode_settings(seed, given) == (params, ChunkSchedule(2, 9, fixed=True))  # the generator's read
    # ensemble_generator reads its client's the same way, with the client's names
    assert contract.decode_settings(7, given, contract.ENSEMBLE_PARAMETERS) == (params, ChunkSchedule(2, 9, fixed=True))
    # a later text segment's: what the listener holds, in whole milliseconds, for the generator only
    seed, given = contract.encode_settings(params, ChunkSchedule(2, 9, buffered=1.2345))
    assert given["buffered_ms"] == 1234 and not given["chunk_fixed"]
    assert contract.decode_settings(seed, given) == (params, ChunkSchedule(2, 9, buffered=1.234))
    cfg = GenerationParams(cfg=0.1 + 0.2)  # a float's exact value crosses as its text (docs/triton.md#T11)
    assert contract.decode_settings(*contract.encode_settings(cfg, DEFAULT_SCHEDULE))[0] == cfg
    assert contract.decode_settings(None, {}) == (
        GenerationParams(1234, 10, 2.0, max_patches=400),
        ChunkSchedule(3, 24),
    )
    with pytest.raises(ValueError, match="unknown request parameters"):
        contract.decode_settings(7, {**given, "max_patch": 3})
    with pytest.raises(ValueError, match="unknown request parameters"):  # a client cannot send it
        contract.decode_settings(7, given, contract.ENSEMBLE_PARAMETERS)
    with pytest.raises(ValueError, match="SEED must be an int64"):
        contract.decode_settings(True, {})


def test_parse_parameters_defaults_and_errors():
    from engine.params import parse_parameters
    from serving.security.auth import parameter_dict

    def request_parameters(raw) -> dict:  # as parse_request reads them
        return parse_parameters(parameter_dict(raw), contract.TTS_PARAMETERS)

    assert request_parameters(None)["chunk_first"] == 3
    assert request_parameters('{"steps": 4, "cfg": 1.5}')["steps"] == 4
    assert request_parameters({"cfg": "1.5"})["cfg"] == 1.5  # BLS requests carry floats as text
    with pytest.raises(ValueError, match="unknown request parameters"):
        request_parameters({"stepz": 3})
    with pytest.raises(ValueError, match="chunk_next"):
        request_parameters({"chunk_next": 0})
    with pytest.raises(ValueError, match="cfg must be a number"):
        request_parameters({"cfg": "lots"})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_request(TTSInputs(text="x", parameters="{steps"))


@pytest.mark.parametrize("value", [2.7, True, "3", None, [3]])
def test_integer_parameters_are_never_truncated(value):
    with pytest.raises(ValueError, match="steps must be an integer"):
        parse_parameters({"steps": value})


def test_parameter_ranges_come_from_one_place():
    p = Parameter("x", int, 1, 1, 5, "")
    assert p.parse(5) == 5
    with pytest.raises(ValueError, match="x must be in 1..5"):
        p.parse(6)
    front_end = {"split_tokens", "normalize", "speed", "read_ahead"}  # tts only: the ensemble speaks one segment
    assert {p.name for p in contract.ENSEMBLE_PARAMETERS} == {p.name for p in contract.TTS_PARAMETERS} - front_end
    flag = Parameter("flag", bool, True, False, True, "")
    assert flag.parse(False) is False
    for bad in (1, 0, "false", None):
        with pytest.raises(ValueError, match="flag must be true or false"):
            flag.parse(bad)


def test_build_request_validation():
    utterance, voice = build_request("Hi", None, None, None, None, None, None, None)
    assert utterance.language is None and utterance.params.seed == 1234 and utterance.schedule == DEFAULT_SCHEDULE
    assert utterance.normalize is True
    utterance, _ = build_request("Hi", "AUTO", None, None, None, None, None, {"normalize": False})
    assert utterance.language is None and utterance.normalize is False
    assert build_request("Hi", "zh_sichuan", None, None, None, None, None, None)[0].language == "ZH_Sichuan"
    assert voice.ref_audio is None and voice.voice_id == ""
    cases = [
        (("", None, None, None, None, None, None, None), "TEXT"),
        (("Hi", "Klingon", None, None, None, None, None, None), "LANGUAGE"),
        (("Hi", None, np.zeros(10, np.float32), None, None, None, None, None), "REF_SAMPLE_RATE"),
        (("Hi", None, np.zeros(0, np.float32), 16000, None, None, None, None), "REF_AUDIO must be a non-empty"),
        (("Hi", None, None, None, "words", None, None, None), "REF_TEXT"),
        (("Hi", None, None, None, None, None, None, {"steps": 500}), "steps"),
    ]
    for args, needle in cases:
        with pytest.raises(ValueError, match=needle):
            build_request(*args)


def test_generator_service_chunks_and_frees(model):
    svc = GeneratorService(model, slots=2, max_len=512)
    prompt = model.encode_prompt(None)
    params = GenerationParams(seed=5, min_patches=7, max_patches=7)
    svc.admit(11, model.tokens("Chunks", "English", prompt), prompt, params, ChunkSchedule(2, 3, fixed=True))
    chunks = run_to_end(svc, 11)
    assert [len(c.latents) for c in chunks] == [8, 12, 8]  # 2 patches, 3 patches, then the last 2
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason == "" for c in chunks[:-1])
    assert np.array_equal(chunks[0].prompt_latents, prompt.latents.numpy())
    assert all(len(c.prompt_latents) == 0 for c in chunks[1:])
    assert svc.active == 0 and list(svc.free) == [1, 0]


def test_generator_service_rejects_bad_input_without_leaking(model):
    svc = GeneratorService(model, slots=1, max_len=64)
    prompt = model.encode_prompt(None)
    with pytest.raises(ValueError, match="cache positions"):
        svc.admit(1, model.tokens("Too long " * 20, "English", prompt), prompt, GenerationParams(max_patches=400))
    assert svc.active == 0
    svc.admit(2, model.tokens("ok", "English", prompt), prompt, GenerationParams(max_patches=6))
    with pytest.raises(ValueError, match="already live"):
        svc.admit(2, model.tokens("ok", "English", prompt), prompt, GenerationParams(max_patches=6))
    with pytest.raises(RuntimeError, match="slots are in use"):
        svc.admit(3, model.tokens("ok", "English", prompt), prompt, GenerationParams(max_patches=6))
    last = svc.cancel(2)
    assert last.last and last.finish_reason == CANCELLED and last.stream_id == 2 and svc.active == 0
    assert not svc.drop(2)  # freeing is one call; a second one finds nothing


def test_vocoder_service_equals_the_reference_and_frees(model):
    params = GenerationParams(seed=9, min_patches=8, max_patches=8)
    prompt = model.encode_prompt(None)
    gen = GeneratorService(model, 1, 512)
    gen.admit(7, model.tokens("Vocoder", "English", prompt), prompt, params)
    voc = VocoderService(model, idle_seconds=60)
    got = np.concatenate([voc.process(c) for c in run_to_end(gen, 7)])
    ref = reference_audio(model, "Vocoder", params)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert voc.active == 0
    with pytest.raises(ValueError, match="unknown"):
        voc.process(Chunk(7, np.zeros((4, 64), np.float32), EMPTY, seq=1))


def test_vocoder_frees_cancelled_and_failed_streams_without_decoding(model):
    voc = VocoderService(model)
    prompt = model.encode_prompt(None).latents.numpy()
    voc.process(Chunk(1, EMPTY, prompt))
    voc.process(Chunk(2, EMPTY, prompt))
    assert voc.active == 2
    assert voc.process(end_chunk(1)).size == 0
    assert voc.process(end_chunk(2, "error: boom")).size == 0
    assert voc.process(end_chunk(3, "invalid: never started")).size == 0  # unknown: nothing to free
    assert voc.active == 0


def test_vocoder_keeps_order_of_one_streams_chunks_in_a_batch(model):
    """Dynamic batching can hand the vocoder two chunks of one stream at once: they decode in order."""
    rng = np.random.default_rng(2)
    prompt = model.encode_prompt(None).latents.numpy()
    chunks = [rng.standard_normal((n, 64)).astype(np.float32) for n in (12, 12, 8)]
    one = VocoderService(model)
    want = [one.process(Chunk(5, chunks[0], prompt)), one.process(Chunk(5, chunks[1], EMPTY)),
            one.process(Chunk(5, chunks[2], EMPTY, True, "stop"))]  # fmt: skip
    together = VocoderService(model)
    got = together.process_many(
        [Chunk(5, chunks[0], prompt), Chunk(5, chunks[1], EMPTY), Chunk(5, chunks[2], EMPTY, True, "stop")]
    )
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert together.active == 0


def test_vocoder_reaps_idle_streams(model):
    voc = VocoderService(model, idle_seconds=0.0)
    voc.process(Chunk(3, EMPTY, model.encode_prompt(None).latents.numpy()))
    assert voc.active == 1
    assert voc.reap() == [3] and voc.active == 0


def test_side_channel_sweeps_old_marks(tmp_path):
    import os

    board = SideChannel(tmp_path / "marks")
    board.mark("cancel", 1)
    board.mark("cancel", 2)
    old = os.path.join(board.dir, "cancel-1")
    os.utime(old, (0, 0))
    (board.dir / "admission").write_bytes(bytes(16))  # other files of the folder are not marks
    os.utime(board.dir / "admission", (0, 0))
    assert board.sweep(60) == 1
    assert 1 not in board.poll()["cancel"] and 2 in board.poll()["cancel"] and (board.dir / "admission").exists()


def test_side_channel_lists_marks_once_per_change(tmp_path):
    board = SideChannel(tmp_path / "marks")
    assert board.poll()["cancel"] == set()
    board.mark("cancel", 7)
    board.mark("cancel", 9)
    assert board.poll()["cancel"] == {7, 9}
    assert board.take("cancel", 7) and board.poll()["cancel"] == {9}
    other = SideChannel(tmp_path / "marks")  # another process's view: its listing follows the folder
    assert other.poll()["cancel"] == {9}
    board.mark("cancel", 11)
    assert other.poll()["cancel"] == {9, 11}


def test_side_channel_lists_again_a_mark_made_in_the_tick_of_its_listing(tmp_path, monkeypatch):
    """A mark made in the kernel tick of a listing leaves the folder's mtime as it was: a poll however much
    later lists the folder again (the next poll after a listing taken well after the last change does not)."""
    import os
    import time

    generator, tts = SideChannel(tmp_path / "marks"), SideChannel(tmp_path / "marks")
    now = time.time_ns()
    os.utime(tts.dir, ns=(now, now))
    assert tts.poll()["lost"] == set()  # listed in the tick of the folder's latest change
    generator.mark("lost", 4)
    os.utime(tts.dir, ns=(now, now))  # ... and a mark made in that same tick
    monkeypatch.setattr(time, "time_ns", lambda: now + 10**9)  # polled a second later
    assert tts.poll()["lost"] == {4} and tts.poll()["lost"] == {4}


def test_side_channel(tmp_path):
    b = SideChannel(tmp_path / "c")
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    assert 5 not in b.poll()["cancel"] and not b.take("cancel", 5)
    b.mark("cancel", 5)
    assert 5 in b.poll()["cancel"]
    assert b.take("cancel", 5) and 5 not in b.poll()["cancel"]
    b.mark("cancel", 6)
    b.unmark("cancel", 6)
    b.unmark("cancel", 6)
    assert 6 not in b.poll()["cancel"]
    with pytest.raises(ValueError):
        b.mark("cancel", "../etc")
    with pytest.raises(ValueError):
        b.mark("admission", 1)  # only the three kinds of marks: never another file of the folder


def test_side_channel_lost_marks_come_in_the_same_listing(tmp_path):
    generator, tts = SideChannel(tmp_path / "marks"), SideChannel(tmp_path / "marks")
    generator.mark("lost", 8)
    generator.mark("cancel", 9)
    assert tts.poll() == {"cancel": {9}, "lost": {8}}
    assert tts.take("lost", 8) and not tts.take("lost", 8)
    assert tts.poll() == {"cancel": {9}, "lost": set()}


def test_stop_head_reason(model):
    svc = GeneratorService(model, slots=1, max_len=600)
    prompt = model.encode_prompt(None)
    svc.admit(1, model.tokens("Stops by itself", "English", prompt), prompt, GenerationParams(seed=7))
    assert run_to_end(svc, 1)[-1].finish_reason == "stop"  # the tiny checkpoint's stop head fires within a few patches


def test_vocoder_reuses_primed_prompt_bit_exactly(model):
    """A second stream with the same prompt starts from a copy of the primed state: same audio."""
    rng = np.random.default_rng(1)
    prompt = model.encode_prompt((0.1 * rng.standard_normal(30000)).astype(np.float32), 16000, "p").latents.numpy()
    chunks = [rng.standard_normal((n, 64)).astype(np.float32) for n in (12, 48, 8)]

    def run(voc, sid):
        out = [voc.process(Chunk(sid, chunks[0], prompt))]
        out += [voc.process(Chunk(sid, c, EMPTY)) for c in chunks[1:]]
        out.append(voc.process(Chunk(sid, EMPTY, EMPTY, True, "stop")))
        return np.concatenate(out)

    cold = run(VocoderService(model, primed_cache=0), 1)
    voc = VocoderService(model, primed_cache=4)
    first, second = run(voc, 1), run(voc, 2)
    assert voc.primed_hits == 1
    assert np.array_equal(first, cold) and np.array_equal(second, cold)


def test_vocoder_batches_streams_past_priming(model):
    """Four streams with different prompts and positions: batched decoding matches one-by-one."""
    rng = np.random.default_rng(3)
    prompts = [model.encode_prompt((0.1 * rng.standard_normal(n)).astype(np.float32), 16000, "").latents.numpy()
               for n in (16000, 30000, 9000, 40000)]  # fmt: skip
    chunks = [[rng.standard_normal((12, 64)).astype(np.float32) for _ in range(4)] for _ in prompts]
    solo, together = VocoderService(model), VocoderService(model)
    want = [[solo.process(Chunk(o, c[0], p))] for o, (p, c) in enumerate(zip(prompts, chunks, strict=True))]
    got = [[together.process(Chunk(o, c[0], p))] for o, (p, c) in enumerate(zip(prompts, chunks, strict=True))]
    for step in range(1, 4):
        end = step == 3
        msgs = [Chunk(o, chunks[o][step], EMPTY, end, "stop" if end else "") for o in range(4)]
        for o in range(4):
            want[o].append(solo.process(msgs[o]))
        for o, out in enumerate(together.process_many(msgs)):
            got[o].append(out)
    assert together.batched_rows >= 8 and solo.batched_rows == 0
    for o in range(4):
        a, b = np.concatenate(want[o]), np.concatenate(got[o])
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert together.active == 0


@pytest.mark.parametrize(
    "bad",
    [
        ["--slots", "0"],
        ["--max-queue", "-5"],
        ["--voice-store-max-gb", "0"],
        ["--start-rate", "-1"],
        ["--step-budget-ms", "-1"],
    ],
)
def test_launcher_refuses_bad_options_before_writing_anything(tmp_path, bad, capsys):
    from serving import serve
    from serving.supervision.triton_env import Ports

    p = Ports.free()
    argv = ["--checkpoint", str(tmp_path), "--work-dir", str(tmp_path / "runs"), "--http-port", str(p.http),
            "--grpc-port", str(p.grpc), "--metrics-port", str(p.metrics), "--no-openai", *bad]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    assert e.value.code == 2 and bad[0].lstrip("-").replace("-", "_") in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("bad, why", [("--agent-sockets 0", "sockets must be > 0"), ("--port 9", "set by the launcher"),
                                      ("--bogus 1", "not options of python -m gateway")])  # fmt: skip
def test_launcher_refuses_bad_gateway_args_before_writing_anything(tmp_path, bad, why, capsys):
    from serving import serve

    argv = ["--checkpoint", str(tmp_path), "--work-dir", str(tmp_path / "runs"), "--gateway-args", bad]
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--gateway-args: " in err and why in err
    assert not (tmp_path / "runs").exists()


def test_kv_cache_and_attention_options_reach_the_generator():
    text = render(ServeOptions(kv_memory_gb=1.5, attention="sdpa"))["generator"]
    assert 'key: "kv_memory_gb" value { string_value: "1.5" }' in text
    assert 'key: "attention" value { string_value: "sdpa" }' in text
    with pytest.raises(ValueError, match="attention must be auto, sdpa or flashinfer"):
        ServeOptions(attention="triton")
    with pytest.raises(ValueError, match="kv_memory_gb must be >= 0"):
        ServeOptions(kv_memory_gb=-1)


def test_watch_cancels_for_a_client_that_left_and_stops_for_a_broken_server(tmp_path):
    import asyncio

    from engine.lifetime import linger
    from serving.stub.bls import watch_request as watch
    from serving.supervision.run_folder import BROKEN, RunFlags

    class Request:
        cancelled = False

        def is_cancelled(self):
            return self.cancelled

    async def run(leave: bool, broken: str | None):
        request, lingering = Request(), []
        launcher, flags = RunFlags(tmp_path), SideChannel(tmp_path / "marks", run_dir=tmp_path)
        launcher.clear()
        cleanup = asyncio.Event()

        async def stream():
            try:
                await asyncio.sleep(10)
            finally:  # a cleanup that outlives the cancelled task, as the orchestrator's does
                lingering.append(linger(asyncio.wait_for(cleanup.wait(), 1)))

        asyncio.get_running_loop().call_later(0.1, lambda: (setattr(request, "cancelled", leave),
                                                            broken and launcher.set(BROKEN, broken)))  # fmt: skip
        asyncio.get_running_loop().call_later(0.3, cleanup.set)
        task, answer = await watch(request, stream(), flags)
        asked_to_stop = task.cancelled() or task.cancelling() > 0  # a broken server: returned without waiting
        awaited = bool(lingering) and all(t.done() for t in lingering)  # the cleanup, linger()ed by the task
        cleanup.set()
        await asyncio.gather(task, *lingering, return_exceptions=True)
        return answer, asked_to_stop, awaited

    assert asyncio.run(run(True, None)) == (None, True, True)  # cancelled, and its cleanup awaited
    answer, cancelled, _ = asyncio.run(run(False, "unavailable: restarting"))
    assert answer == "unavailable: restarting" and cancelled


def test_a_paused_stream_keeps_its_slot_and_its_math(model):
    """A live stream left out of steps (paused by tts: serving.flow.pacing) keeps its slot and pages, its
    clock does not count the steps it sat out, and its chunks are bit for bit those of the same stream never
    paused. (Who shares a step moves float32 rounding, ~1e-5: each run here steps its stream alone.)"""
    prompt = model.encode_prompt(None)
    params = GenerationParams(seed=5, min_patches=7, max_patches=7)
    tokens = model.tokens("Paused", "English", prompt)

    def run(sat_out: range) -> list:
        now = [0.0]
        svc = GeneratorService(model, slots=2, max_len=512, clock=lambda: now[0])
        svc.admit(2, tokens, prompt, params, ChunkSchedule(2, 3, fixed=True))
        chunks = []
        for k in range(20):
            now[0] += 100.0 if k == 3 else 0.1  # one of the steps it sits out is 100 s long
            chunk = svc.step([] if k in sat_out else [2]).get(2)
            if chunk is not None:
                chunks.append(chunk)
            if k == 4 and sat_out:
                assert svc.active == 1 and svc.scheduler.streams[2].slot is not None and len(svc.free) == 1
                assert svc.live[2].clock.step < 1.0  # the 100 s it sat out is no step of its
            if not svc.live:
                break
        return chunks

    paused, never = run(range(2, 6)), run(range(0))
    assert [len(c.latents) for c in paused] == [len(c.latents) for c in never] == [8, 12, 8]
    for a, b in zip(paused, never, strict=True):
        np.testing.assert_array_equal(a.latents, b.latents)
