"""Render the Triton model repository: each ``config.pbtxt`` from :mod:`serving.contract` and the model's options,
each ``model.py`` copied from ``model_repository/``, whose committed configs are the defaults' (a test checks)."""

from __future__ import annotations

import shutil
from pathlib import Path

from serving import contract
from serving.config import model_options as mo
from serving.config.options import ServeOptions

SOURCE = Path(__file__).resolve().parents[2] / "model_repository"


def _io(inputs, outputs, ragged=()) -> str:
    ins = ",\n  ".join(s.pbtxt(ragged=s.name in ragged) for s in inputs)
    outs = ",\n  ".join(s.pbtxt() for s in outputs)
    return f"input [\n  {ins}\n]\noutput [\n  {outs}\n]\n"


RENDERED = "# Rendered by serving.config.repository from serving/contract.py; edit those, not this file.\n"


def _python(options: mo.ModelOptions, max_batch: int, inputs, outputs, ragged=(), decoupled=True, batching="",
            instances: int = 1) -> str:  # fmt: skip
    """A Python-backend model's config.pbtxt: ``instances`` CPU instances (stub processes), its options as (quoted)
    string parameters."""
    quoted = lambda text: text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return (f'name: "{options.MODEL}"\n{RENDERED}backend: "python"\nmax_batch_size: {max_batch}\n'
            + ("model_transaction_policy { decoupled: true }\n" if decoupled else "") + batching + _io(inputs, outputs,
            ragged) + f"instance_group [ {{ kind: KIND_CPU count: {instances} }} ]\n"
            + "".join(f'parameters {{ key: "{k}" value {{ string_value: "{quoted(v)}" }} }}\n'
                      for k, v in options.parameters().items()))  # fmt: skip


def render(opts: ServeOptions) -> dict[str, str]:
    """model name -> config.pbtxt text."""
    gen, prompt = ("PROMPT_LATENTS", "SPEAKER"), mo.PromptEncoderOptions.of(opts)
    # its queue is bounded: key-less requests (tts_ensemble's first step) are answered here before the gate
    batching = ("dynamic_batching {\n  max_queue_delay_microseconds: 2000\n"
                f"  default_queue_policy {{ max_queue_size: {2 * prompt.capacity} }}\n}}\n")  # fmt: skip
    models = {
        "tts": _python(mo.TTSOptions.of(opts), 0, contract.TTS_INPUTS, contract.TTS_OUTPUTS, instances=opts.tts_instances),
        "tts_ensemble": ensemble(),
        "prompt_encoder": _python(prompt, 8, contract.PROMPT_INPUTS, contract.PROMPT_OUTPUTS, ("REF_AUDIO",),
                                  decoupled=False, batching=batching),
        "ensemble_generator": _python(mo.EnsembleGeneratorOptions.of(opts), 1, contract.GENERATOR_INPUTS,
                                      contract.GENERATOR_OUTPUTS, gen),
        # decoupled, one request per stream, stepped by its own engine thread: no batcher (serving.stub.generator_host)
        "generator": _python(mo.GeneratorOptions.of(opts), 1, contract.GENERATOR_INPUTS,
                             contract.GENERATOR_OUTPUTS + contract.PIPE_OUTPUTS, gen),
        # decoupled with its own engine thread, not Triton's dynamic batcher: see model_repository/vocoder
        "vocoder": _python(mo.VocoderOptions.of(opts), opts.vocoder_batch, contract.VOCODER_INPUTS,
                           contract.VOCODER_OUTPUTS, ("LATENTS", "PROMPT_LATENTS")),
        "voices": _python(mo.VoicesOptions.of(opts), 0, contract.VOICES_INPUTS, contract.VOICES_OUTPUTS, decoupled=False),
    }  # fmt: skip
    if not opts.ensemble:
        del models["tts_ensemble"], models["ensemble_generator"]
    return models


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'    {{ model_name: "{model}" model_version: -1\n      ' + "\n      ".join(maps) + " }"


def ensemble() -> str:
    """tts_ensemble: prompt_encoder -> ensemble_generator (a generator stream over BLS; its chunks carry every
    vocoder input, and it gets the client's request parameters as sent) -> vocoder (one request a chunk)."""
    given = {s.name for s in contract.ENSEMBLE_INPUTS}
    prompt_in = {s.name: s.name for s in contract.PROMPT_INPUTS if s.name in given}
    prompt_out = {s.name: f"_{s.name.lower()}" for s in contract.PROMPT_OUTPUTS}
    # the generator says what the front end made of TEXT (prompt_encoder's SPOKEN_TEXT and SPOKEN_LANGUAGE)
    prompt_out_for = {**{s.name: prompt_out[s.name] for s in contract.VOICE_PROMPT_OUTPUTS},
                      "TEXT": prompt_out["SPOKEN_TEXT"], "LANGUAGE": prompt_out["SPOKEN_LANGUAGE"]}  # fmt: skip
    # Instruct's optional inputs are not tts_ensemble's: it serves Base only
    gen_in = {s.name: prompt_out_for.get(s.name, s.name) for s in contract.GENERATOR_INPUTS
              if s.name in prompt_out_for or s.name in given}  # fmt: skip
    gen_out = {s.name: f"_gen_{s.name.lower()}" for s in contract.VOCODER_INPUTS}  # what the vocoder reads
    steps = [
        _step("prompt_encoder", prompt_in, prompt_out),
        _step("ensemble_generator", gen_in, gen_out),
        _step("vocoder", {s.name: gen_out[s.name] for s in contract.VOCODER_INPUTS},
              {s.name: s.name for s in contract.VOCODER_ENSEMBLE_OUTPUTS}),
    ]  # fmt: skip
    return (RENDERED + 'name: "tts_ensemble"\nplatform: "ensemble"\nmax_batch_size: 0\n'
            + _io(contract.ENSEMBLE_INPUTS, contract.ENSEMBLE_OUTPUTS)
            + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n")  # fmt: skip


def build(dest: Path, opts: ServeOptions) -> Path:
    """Write a complete model repository to ``dest`` (replacing it), readable by this user only (the generator's
    folder gets its secret name: serving.security.auth.Keys.generator_model)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, mode=0o700)
    dest.chmod(0o700)  # whatever the umask
    for name, text in render(opts).items():
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "config.pbtxt").write_text(text)
        if (SOURCE / name / "1" / "model.py").is_file():  # an ensemble has none
            shutil.copy2(SOURCE / name / "1" / "model.py", dest / name / "1" / "model.py")
    return dest


if __name__ == "__main__":  # rewrite the committed default configs: python -m serving.config.repository
    for name, text in render(ServeOptions()).items():
        (SOURCE / name / "1").mkdir(parents=True, exist_ok=True)
        (SOURCE / name / "config.pbtxt").write_text(text)
