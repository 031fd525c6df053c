"""Every Triton model's ``initialize``/``execute`` in-process, under the fake ``triton_python_backend_utils``
(tests/fakes/pb.py): the real model.py files and engine on the tiny checkpoint, BLS calls answered by
the other models loaded beside them. No tritonserver: these run in seconds, and reach the paths that
the integration tests only reach through a live server (the vocoder's guard, tts's BLS calls, the
generator's pipe and its one request per stream, stepped by its engine thread)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from engine.params import GenerationParams
from engine.protocol import FORBIDDEN, INVALID, LENGTH, STOP
from serving.config.model_options import (
    EnsembleGeneratorOptions,
    GeneratorOptions,
    PromptEncoderOptions,
    TTSOptions,
    VocoderOptions,
    VoicesOptions,
)
from serving.config.options import ServeOptions
from serving.security.auth import ADMIN_DIGEST_ENV, INTERNAL_KEY_ENV, INTERNAL_PARAMETER, Keys
from serving.stub.vocoder_batch import request_values
from tests.fakes import pb as fake
from tests.reference import reference_audio, reference_latents, spoken

KEY, ADMIN = "k" * 64, "the-admin-key"
RUNNER_NICENESS = os.nice(0)  # the test runner's, at import
TEXT = np.object_


def strings(**values) -> dict[str, np.ndarray]:
    return {k: np.array([v.encode()], TEXT) for k, v in values.items()}


@pytest.fixture(scope="module")
def triton(tiny_ckpt, tmp_path_factory):
    """The five models of the tts pipeline, loaded as Triton would load them, under the run's keys."""
    work = tmp_path_factory.mktemp("in_process")
    opts = ServeOptions(checkpoint=str(tiny_ckpt), slots=2, max_len=1024, cancel_dir=str(work / "cancel"),
                        voice_dir=str(work / "voices"))  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        mp.setenv(INTERNAL_KEY_ENV, KEY)
        mp.setenv(ADMIN_DIGEST_ENV, Keys.digest(ADMIN))
        with fake.FakeTriton() as server:
            load = server.load
            server.prompt_encoder = server.serve("prompt_encoder", load("prompt_encoder",
                                                 PromptEncoderOptions.of(opts).parameters()))  # fmt: skip
            server.generator = server.serve(Keys(KEY).generator_model,
                                            load("generator", GeneratorOptions.of(opts).parameters()))  # fmt: skip
            server.vocoder = server.serve("vocoder", load("vocoder", VocoderOptions.of(opts).parameters()), 64)
            server.voices = load("voices", VoicesOptions.of(opts).parameters())
            server.tts = load("tts", TTSOptions.of(opts).parameters())
            server.ensemble = load("ensemble_generator", EnsembleGeneratorOptions.of(opts).parameters())
            server.opts = opts
            yield server
            server.tts.finalize()
            server.ensemble.finalize()


def run_tts(server, inputs: dict, parameters: dict | None = None) -> fake.ResponseSender:
    request = fake.request(inputs, parameters)
    server.execute(server.tts, [request])
    return request.sender


def test_tts_streams_audio_equal_to_offline_and_frees_everything(triton, model):
    inputs = {**strings(TEXT="Hello in process"), "SEED": np.array([5], np.int64)}
    sender = run_tts(triton, inputs, {"max_patches": 6})
    assert sender.finals == 1 and sender.sent[-1][1] == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert sender.errors() == []
    outputs = sender.outputs()
    assert len(outputs) >= 2  # streamed: audio before the final response
    got = np.concatenate([o["AUDIO"] for o in outputs if "AUDIO" in o])
    ref = reference_audio(model, spoken(model, "Hello in process"), GenerationParams(seed=5, max_patches=6))
    assert got.shape == ref.shape == (6 * 3840,)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert outputs[-1]["FINISH_REASON"][0].decode() in (LENGTH, STOP)
    assert not triton.generator.host.service.live and not triton.generator.host.pipes.riding
    assert triton.vocoder.service.active == 0


def test_a_pipe_the_generator_ended_is_opened_again_by_the_next_stream(triton):
    inputs = {**strings(TEXT="Again"), "SEED": np.array([3], np.int64)}
    pipe = triton.tts.entry.generator.pipe
    assert run_tts(triton, inputs, {"max_patches": 4}).errors() == []
    first = pipe.pipe_id
    triton.generator.host.channel.mark("cancel", first)  # the generator ends it (as when its reader left)
    deadline = time.monotonic() + 10
    while pipe.pipe_id == first:  # the reader heard its end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sender = run_tts(triton, inputs, {"max_patches": 4})
    assert sender.errors() == [] and any("AUDIO" in o for o in sender.outputs())
    assert pipe.pipe_id not in (0, first) and first not in triton.generator.host.pipes.open


def test_a_worn_pipe_is_rotated_and_the_generator_ends_it_after_its_streams(triton, monkeypatch):
    """docs/triton.md#T25: a pipe that has carried its bound is left for a new one; the generator ends the
    old one once its streams are over, and the reader lets go of its iterator. The audio is the same."""
    from serving.stub import pipe_reader

    inputs = {**strings(TEXT="Rotated"), "SEED": np.array([4], np.int64)}
    pipe = triton.tts.entry.generator.pipe
    before = run_tts(triton, inputs, {"max_patches": 4})
    assert before.errors() == []
    first = pipe.pipe_id
    monkeypatch.setattr(pipe_reader, "ROTATE_RESPONSES", 1)  # every pipe is worn after its first response
    after = run_tts(triton, inputs, {"max_patches": 4})
    assert after.errors() == [] and pipe.pipe_id not in (0, first)
    deadline = time.monotonic() + 10
    while first in pipe.readings:  # the generator ended it; its reading thread heard the end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert first not in triton.generator.host.pipes.open and first not in pipe.carried and not pipe.draining
    np.testing.assert_allclose(*(np.concatenate([o["AUDIO"] for o in s.outputs() if "AUDIO" in o]) for s in (before, after)),
                               atol=1e-5)  # fmt: skip


def test_tts_instruct_design_makes_the_offline_plan_and_audio(triton, model):
    """An Instruct request checked once, by tts (the generator takes its task, instruction and text as tts
    sends them): the plan and audio of offline synthesis for the same request, instruction spaces and all."""
    from engine.synthesize import instruct_run

    sender = run_tts(triton, strings(TEXT="Designed here.", INSTRUCTION="  a calm older man "), {"max_patches": 6})
    assert sender.finals == 1 and sender.errors() == []
    outputs = sender.outputs()
    plans = [o["PLAN_TEXT"].reshape(-1)[0].decode() for o in outputs if "PLAN_TEXT" in o]
    got = np.concatenate([o["AUDIO"] for o in outputs if "AUDIO" in o])
    offline = instruct_run(model, "design", "Designed here.", "  a calm older man ", max_patches=6)
    assert plans == [offline.plan_text]
    assert got.shape == offline.audio.shape and got.size > 0
    np.testing.assert_allclose(got, offline.audio, atol=1e-5)
    assert not triton.generator.host.service.live


def test_tts_bad_input_ends_with_one_final_error_naming_it(triton):
    sender = run_tts(triton, {**strings(TEXT="fine"), "SEED": np.array([1], np.int64)}, {"max_patches": "six"})
    assert sender.finals == 1 and len(sender.sent) == 1
    (error,) = sender.errors()
    assert error.startswith(INVALID) and "max_patches" in error
    assert sender.sent[0][0].error().code() == fake.TritonError.INVALID_ARG


def test_tts_unknown_voice_is_invalid_naming_the_voice(triton):
    sender = run_tts(triton, strings(TEXT="fine", VOICE_ID="nobody_here"))
    (error,) = sender.errors()
    assert sender.finals == 1 and error.startswith(INVALID) and "nobody_here" in error


def test_prompt_encoder_encodes_as_offline_and_refuses_by_name(triton, model):
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    given = {"REF_AUDIO": audio[None], "REF_SAMPLE_RATE": np.array([[16000]], np.int32),
             **{k: v[None] for k, v in strings(REF_TEXT="a reference").items()}}  # fmt: skip
    ours = {INTERNAL_PARAMETER: KEY}
    (response,) = triton.prompt_encoder.execute([fake.request(given, ours)])
    out = {t.name(): t.as_numpy() for t in response.output_tensors()}
    expected = model.encode_prompt(audio, 16000, "a reference")
    np.testing.assert_allclose(out["PROMPT_LATENTS"][0], expected.latents.numpy(), atol=1e-5)
    np.testing.assert_allclose(out["SPEAKER"][0], expected.speaker.numpy(), atol=1e-5)
    both = {**given, "VOICE_ID": np.array([[b"x"]], TEXT)}
    keyless = {**given, "REGISTER_NAME": np.array([[b"mine"]], TEXT)}
    answers = triton.prompt_encoder.execute([fake.request(both), fake.request(keyless)])
    messages = [r.error().message() for r in answers]
    assert messages[0].startswith(INVALID) and "VOICE_ID" in messages[0]
    assert messages[1].startswith(FORBIDDEN) and "voices model" in messages[1]


def test_the_encoders_niceness_is_asked_for_but_the_test_runner_keeps_its_own(triton):
    assert fake.RENICED["prompt_encoder"] == [10]  # its stub runs behind the streams (a process of its own)
    assert os.nice(0) == RUNNER_NICENESS  # in process: not applied to the runner and the tests after it


def test_prompt_encoder_checks_every_key_less_voice(triton):
    """tts checked what it sends with the internal key (parse_request); a key-less request (tts_ensemble's
    first step) gets the same checks (serving.intake.requests.check_voice), with the same messages."""
    clip = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    rate = np.array([[16000]], np.int32)
    bad = {
        "REF_AUDIO": {"REF_AUDIO": np.where(np.arange(16000) == 7, np.nan, clip)[None].astype(np.float32),
                      "REF_SAMPLE_RATE": rate},
        "REF_SAMPLE_RATE": {"REF_AUDIO": clip[None], "REF_SAMPLE_RATE": np.array([[7]], np.int32)},
        "VOICE_ID": {"VOICE_ID": np.array([[b"../etc"]], TEXT)},
        "REF_TEXT": {"REF_AUDIO": clip[None], "REF_SAMPLE_RATE": rate,
                     "REF_TEXT": np.array([["say <|eot|>".encode()]], TEXT)},
        "REF_TEXT was given without REF_AUDIO": {"REF_TEXT": np.array([[b"words without a clip"]], TEXT)},
        "REF_SAMPLE_RATE was given without REF_AUDIO": {"REF_SAMPLE_RATE": rate},
        "not both": {"VOICE_ID": np.array([[b"narrator"]], TEXT), "REF_AUDIO": clip[None], "REF_SAMPLE_RATE": rate},
    }  # fmt: skip
    answers = triton.prompt_encoder.execute([fake.request(inputs) for inputs in bad.values()])
    for named, response in zip(bad, answers, strict=True):
        message = response.error().message()
        assert message.startswith(INVALID) and named in message, (named, message)


def test_voices_add_list_remove_through_prompt_encoder(triton):
    def voices(action: str, admin: bool = True, **more):
        request = fake.request({**{k: v[None] for k, v in strings(ACTION=action, **more).items()}},
                               {"admin_key": ADMIN} if admin else {})  # fmt: skip
        (response,) = triton.voices.execute([request])
        if response.has_error():
            return response.error().message()
        return json.loads(fake.get_output_tensor_by_name(response, "RESULT").as_numpy()[0])

    audio = (0.1 * np.random.default_rng(1).standard_normal(8000)).astype(np.float32)
    add = fake.request({**{k: v[None] for k, v in strings(ACTION="add", NAME="alice").items()},
                        "REF_AUDIO": audio[None], "REF_SAMPLE_RATE": np.array([[16000]], np.int32)},
                       {"admin_key": ADMIN})  # fmt: skip
    (added,) = triton.voices.execute([add])
    assert not added.has_error(), added.error() and added.error().message()
    assert "alice" in [v["name"] for v in voices("list")]
    assert voices("remove", admin=False, NAME="alice").startswith(FORBIDDEN)
    assert voices("remove", NAME="alice") == {"name": "alice", "removed": True}
    assert "alice" not in [v["name"] for v in voices("list")]


def test_vocoder_guard_answers_every_forged_chunk_once(triton):
    """Chunks the generator never made (unsealed ids, key-less or ours) decode nothing: each request
    gets one final response whose rows name why."""
    from engine.protocol import Chunk

    chunks = [Chunk(stream_id=7 + i, latents=np.zeros((4, 64), np.float32),
                    prompt_latents=np.zeros((4, 64), np.float32), last=False, finish_reason="", seq=0, seal=123)
              for i in range(2)]  # fmt: skip
    inputs = dict(request_values(chunks))
    requests = [fake.request(inputs, {INTERNAL_PARAMETER: KEY}), fake.request(inputs),
                fake.request(inputs, {INTERNAL_PARAMETER: "wrong"})]  # fmt: skip
    triton.vocoder.execute(requests)
    for r in requests:
        assert r.sender.closed.wait(30)
        assert r.sender.finals == 1 and len(r.sender.sent) == 1
    for r in requests[:2]:
        (out,) = r.sender.outputs()
        assert out["SAMPLES"].reshape(-1).tolist() == [0, 0]
        reasons = [v.decode() for v in out["FINISH_REASON"].reshape(-1)]
        assert all(reason.startswith("invalid:") and "unknown stream" in reason for reason in reasons), reasons
    (out,) = requests[2].sender.outputs()  # a wrong key is key-less: the ensemble's steps are public
    assert out["SAMPLES"].reshape(-1).tolist() == [0, 0]
    assert triton.vocoder.service.active == 0


def test_vocoder_engine_takes_what_has_queued_up_to_its_batch_of_chunks(triton):
    """The engine thread's take: the first request, then what has queued without waiting, until they hold
    ``most`` chunks (a request is never split); what is left goes in the next batch."""
    import queue

    take = triton.vocoder._run.__globals__["take"]
    q = queue.SimpleQueue()
    for rows in (3, 2, 4, 1):
        q.put(rows)
    assert take(q, 5, lambda rows: rows, timeout=0) == [3, 2]
    assert take(q, 5, lambda rows: rows, timeout=0) == [4, 1]
    assert take(q, 5, lambda rows: rows, timeout=0) == []


def test_generator_streams_one_request_to_its_last_chunk_on_its_pipe_and_refuses_keyless(triton, model):
    """The generator's execute as Triton calls it: a pipe's opening (answered at once, empty), then one
    request per stream naming the pipe, released at once and answered by one empty final response once
    admitted; the engine thread steps it and its chunks come on the pipe, the last one marked. A key-less
    request, and a stream that names no pipe, are refused at once, by name."""
    from serving.stub.chunk_pipe import unpack

    gen = triton.generator
    sid, pipe_id = 0x1234567, 0x7654321
    prompt = model.encode_prompt(None)
    inputs = {**strings(TEXT="Generated here", LANGUAGE="English", PROMPT_TEXT=prompt.text),
              "SEED": np.array([3], np.int64), "PROMPT_LATENTS": prompt.latents.numpy(),
              "SPEAKER": prompt.speaker.numpy()}  # fmt: skip
    start = fake.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    keyless = fake.request(inputs, {}, correlation_id=sid + 1, flags=start)
    gen.execute([keyless])
    assert keyless.sender.finals == 1 and keyless.sender.errors()[0].startswith(FORBIDDEN)
    stream = {INTERNAL_PARAMETER: KEY, "max_patches": 6, "chunk_fixed": True, "chunk_first": 1, "chunk_next": 1}
    pipeless = fake.request(inputs, stream, correlation_id=sid + 2, flags=start)
    gen.execute([pipeless])
    assert pipeless.sender.finals == 1 and pipeless.sender.closed.is_set()
    ((refused,),) = [unpack(out.get) for out in pipeless.sender.outputs()]  # packed, as every response it sends
    assert "pipe" in refused.finish_reason and refused.last
    pipe = fake.request(inputs, {INTERNAL_PARAMETER: KEY, "pipe": "open"}, correlation_id=pipe_id, flags=start)
    gen.execute([pipe])
    request = fake.request(inputs, {**stream, "pipe": f"{pipe_id:x}"}, correlation_id=sid, flags=start)
    gen.execute([request])
    assert request.release_flags != fake.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE  # never back in a batch
    assert request.sender.closed.wait(60)
    assert request.sender.finals == 1 and request.sender.outputs() == [{}]  # admitted: its chunks on the pipe
    chunks: list = []
    deadline = time.monotonic() + 60
    while not (chunks and chunks[-1].last):
        assert time.monotonic() < deadline
        time.sleep(0.01)
        chunks = [c for out in pipe.sender.outputs() if out for c in unpack(out.get) if c.stream_id == sid]
    assert pipe.sender.outputs()[0] == {} and not pipe.sender.closed.is_set()  # the opening; the pipe stays open
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    got = np.concatenate([c.latents for c in chunks])
    ref = reference_latents(model, "Generated here", GenerationParams(seed=3, max_patches=6), prompt, invariant=True)
    assert got.shape == ref.shape == (6 * 4, 64)  # 6 patches of 4 latents: a chunk each
    np.testing.assert_array_equal(got, ref.numpy())  # the same bits: both batch-invariant (CPU serving)
    assert [len(c.latents) for c in chunks if len(c.latents)] == [4] * 6
    assert chunks[-1].finish_reason == LENGTH and all(gen.host.keys.sealed(c) for c in chunks)
    gen.host.channel.mark("cancel", pipe_id)  # its reader ends it
    assert pipe.sender.closed.wait(10) and pipe.sender.finals == 1
    assert not gen.host.service.live and pipe_id not in gen.host.pipes.open


def test_ensemble_generator_relays_the_generators_chunks_and_fails_in_band(triton, model):
    """tts_ensemble's middle step: the generator's chunks (through BLS) as its own responses, the last
    one final; a bad input is a normal final response whose FINISH_REASON names it (docs/triton.md#T12)."""
    prompt = model.encode_prompt(None)
    inputs = {**{k: v[None] for k, v in strings(TEXT="Relayed words", LANGUAGE="English", PROMPT_TEXT="").items()},
              "SEED": np.array([[4]], np.int64), "PROMPT_LATENTS": prompt.latents.numpy()[None],
              "SPEAKER": prompt.speaker.numpy()[None]}  # fmt: skip
    request = fake.request(inputs, {"max_patches": 6})
    triton.execute(triton.ensemble, [request])
    outs = request.sender.outputs()
    assert request.sender.finals == 1 and request.sender.errors() == []
    assert [bool(o["LAST"].reshape(-1)[0]) for o in outs] == [False] * (len(outs) - 1) + [True]
    got = np.concatenate([o["LATENTS"].reshape(-1, 64) for o in outs])
    ref = reference_latents(model, "Relayed words", GenerationParams(seed=4, max_patches=6), prompt, invariant=True)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got, ref.numpy())
    bad = fake.request({**inputs, "SPEAKER": np.zeros((1, 3), np.float32)}, {"max_patches": 6})
    triton.execute(triton.ensemble, [bad])
    (out,) = bad.sender.outputs()
    reason = out["FINISH_REASON"].reshape(-1)[0].decode()
    assert bad.sender.finals == 1 and reason.startswith(INVALID) and "SPEAKER" in reason
