"""Options written once: rendered into each config.pbtxt and read back by the model, and the launcher's flags."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace

import pytest

from serving.config.model_options import (
    EnsembleGeneratorOptions,
    GeneratorOptions,
    PromptEncoderOptions,
    TTSOptions,
    VocoderOptions,
    VoicesOptions,
)
from serving.config.options import ServeOptions, add_arguments, from_arguments
from serving.config.repository import render
from tests.docs import pages

MODELS = {"tts": TTSOptions, "prompt_encoder": PromptEncoderOptions, "ensemble_generator": EnsembleGeneratorOptions,
          "generator": GeneratorOptions, "vocoder": VocoderOptions, "voices": VoicesOptions}  # fmt: skip
ODD = ServeOptions(checkpoint='/ck "quoted" \\ dir', slots=3, max_len=512, kv_memory_gb=1.5, attention="sdpa",
                   vocoder_batch=16, vocoder_idle_seconds=7, voice_dir="/v",
                   max_anonymous_voices=9, voice_store_max_gb=0.25, device="cuda:1", bls_timeout_seconds=33,
                   cancel_dir="/c", run_dir="/r", max_queue=5, ensemble=False)  # fmt: skip
PARAMETER = re.compile(r'parameters \{ key: "([^"]+)" value \{ string_value: "((?:[^"\\]|\\.)*)" \} \}')


def parameters_of(text: str) -> dict[str, str]:
    """A config's parameters as Triton hands them to a model (protobuf text escapes undone)."""
    return {k: re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), v) for k, v in PARAMETER.findall(text)}


def triton_args(params: dict[str, str]) -> dict:
    return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})}


@pytest.mark.parametrize("opts", [ServeOptions(), ODD, replace(ODD, ensemble=True)], ids=["default", "odd", "odd+ens"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_model_reads_back_what_was_rendered(model, opts):
    rendered = render(opts)
    if model not in rendered:  # served with the ensemble only
        assert model == "ensemble_generator" and not opts.ensemble
        return
    params = parameters_of(rendered[model])
    cls = MODELS[model]
    assert cls.read(triton_args(params)) == cls.of(opts)


def test_rendered_values_are_the_options_given():
    models = {name: triton_args(parameters_of(text)) for name, text in render(ODD).items()}
    gen = GeneratorOptions.read(models["generator"])
    assert (gen.checkpoint, gen.device, gen.slots, gen.max_len) == ('/ck "quoted" \\ dir', "cuda:1", 3, 512)
    assert (gen.kv_memory_gb, gen.attention, gen.cancel_dir, gen.run_dir) == (1.5, "sdpa", "/c", "/r")
    voc = VocoderOptions.read(models["vocoder"])
    # max_streams: slots + queue + spare
    assert (voc.max_streams, voc.idle_seconds, voc.batch) == (3 + 5 + 64, 7, 16)
    assert voc.public_steps is False
    prompt = PromptEncoderOptions.read(models["prompt_encoder"])
    assert (prompt.voice_dir, prompt.max_anonymous_voices, prompt.voice_store_max_gb) == ("/v", 9, 0.25)
    assert (prompt.public_steps, prompt.capacity) == (False, 3 + 5)
    tts = TTSOptions.read(models["tts"])
    assert (tts.bls_timeout_seconds, tts.capacity) == (33, 8)
    assert TTSOptions.read(triton_args(parameters_of(render(ServeOptions(slots=3))["tts"]))).capacity == 3 + 4 * 3
    assert VoicesOptions.read(models["voices"]).bls_timeout_seconds == 33
    prompt = triton_args(parameters_of(render(ServeOptions())["prompt_encoder"]))
    assert PromptEncoderOptions.read(prompt).public_steps is True


def test_a_bad_parameter_is_named():
    good = parameters_of(render(ServeOptions())["generator"])
    for name, value, needle in [("slots", "2.5", "'slots' must be an integer"),
                                ("kv_memory_gb", "lots", "'kv_memory_gb' must be a finite number"),
                                ("kv_memory_gb", "nan", "'kv_memory_gb' must be a finite number")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            GeneratorOptions.read(triton_args({**good, name: value}))
    with pytest.raises(ValueError, match="no parameter 'max_len'"):
        GeneratorOptions.read(triton_args({k: v for k, v in good.items() if k != "max_len"}))
    with pytest.raises(ValueError, match=r"unknown parameters \['slotz'\]"):
        GeneratorOptions.read(triton_args({**good, "slotz": "3"}))
    vocoder = parameters_of(render(ServeOptions())["vocoder"])
    with pytest.raises(ValueError, match="vocoder parameter 'public_steps' must be 1 or 0"):
        VocoderOptions.read(triton_args({**vocoder, "public_steps": "yes"}))


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


def test_launcher_flags_come_from_the_options():
    assert from_arguments(_parse([])) == ServeOptions()
    argv = ["--checkpoint", "/ck", "--slots", "3", "--max-len", "512", "--kv-memory-gb", "1.5", "--attention", "sdpa",
            "--voice-dir", "/v", "--max-anonymous-voices", "9", "--voice-store-max-gb", "0.25", "--device", "cuda:1",
            "--max-queue", "5", "--no-ensemble"]  # fmt: skip
    want = ServeOptions(checkpoint="/ck", slots=3, max_len=512, kv_memory_gb=1.5, attention="sdpa", voice_dir="/v",
                        max_anonymous_voices=9, voice_store_max_gb=0.25, device="cuda:1", max_queue=5,
                        ensemble=False)  # fmt: skip
    assert from_arguments(_parse(argv)) == want
    assert from_arguments(_parse(["--checkpoint", "/ck"]), checkpoint="/resolved").checkpoint == "/resolved"
    with pytest.raises(SystemExit):
        _parse(["--attention", "triton"])
    with pytest.raises(SystemExit):
        _parse(["--slots", "2.5"])
    assert from_arguments(_parse(["--attention", "flashinfer"])).attention == "flashinfer"


def test_the_docs_name_every_launcher_option():
    """Somewhere in README.md or docs/*.md."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    readme = "\n".join(pages().values())
    for action in ap._actions[1:]:
        flag = action.option_strings[-1]  # --no-ensemble for a boolean
        assert re.search(rf"{re.escape(flag)}(?![\w-])", readme), flag


@pytest.mark.parametrize(("given", "device", "on"), [("auto", "cpu", True), ("auto", "cuda", False),
                         ("auto", "cuda:1", False), ("on", "cuda", True), ("off", "cpu", False)])  # fmt: skip
def test_batch_invariant_auto_is_on_for_cpu_and_off_for_cuda(given, device, on):
    opts = ServeOptions(batch_invariant=given, device=device)
    assert GeneratorOptions.of(opts).batch_invariant is on and VocoderOptions.of(opts).batch_invariant is on


def test_batch_invariant_takes_auto_on_or_off():
    with pytest.raises(ValueError, match="batch_invariant"):
        ServeOptions(batch_invariant="yes")
