"""Render the Triton model repository: ``config.pbtxt`` of each model from :mod:`serving.contract` and
the serving options; ``model.py`` files are copied from ``model_repository/`` as they are.

The committed ``model_repository/*/config.pbtxt`` are this module's output for the default options
(a unit test keeps them in sync), so the folder also works when pointed at directly.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from serving import contract as C

SOURCE = Path(__file__).resolve().parent.parent / "model_repository"
MODELS = ("tts", "tts_ensemble", "prompt_encoder", "generator", "vocoder", "voices")


@dataclass(frozen=True)
class ServeOptions:
    checkpoint: str = ""  # empty: models read $FIRERED_CHECKPOINT
    slots: int = 8  # generator streams stepped together (KV cache rows)
    max_len: int = 2048  # backbone positions per slot (prompt + text + generated patches)
    # The backbone's paged KV cache: its size in GiB (0: slots x max_len positions, the memory the
    # per-slot cache took) and the attention path over it ("auto": FlashInfer when usable, else SDPA).
    kv_memory_gb: float = 0.0
    attention: str = "auto"
    # How long the sequence batcher waits for rescheduled streams before stepping: with 0 it often
    # stepped a split batch (17 of 63 steps ran one stream alone, small preset, 8 slots); 500 us kept
    # the batch whole at no measurable cost (bench/step_overhead.py).
    generator_queue_delay_us: int = 500
    vocoder_batch: int = 64  # vocoder chunks handed to one execute (one instance, dynamic batching)
    vocoder_queue_delay_us: int = 1000  # how long the vocoder's batcher gathers chunks of several streams
    vocoder_idle_seconds: int = 60  # abandoned vocoder state is reclaimed after this
    voice_dir: str = ""  # empty: serving.voice_store.default_dir()
    max_anonymous_voices: int = 256  # LRU bound of anonymous reference prompts kept on disk
    voice_store_max_gb: float = 2.0  # bound on the voice store's files (1 GB = 1e9 bytes); named voices are kept
    device: str = "cpu"
    bls_timeout_seconds: int = 120  # every BLS call from tts
    cancel_dir: str = ""  # tts -> generator cancellation marks (default: serving.cancel.default_dir())
    run_dir: str = ""  # the launcher's run folder: heartbeats and flags (serving.supervise); empty: none
    max_queue: int = -1  # tts requests that may wait for a slot beyond the running ones (-1: 4 x slots)
    # Serve tts_ensemble. Its steps cannot carry the internal key, so the internal models then also take
    # key-less requests for what the ensemble does (see serving.auth); without it they refuse them.
    ensemble: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 256:
            raise ValueError(f"slots must be in 1..256, got {self.slots}")
        if self.max_len < 64:
            raise ValueError("max_len must be >= 64")
        if not self.voice_store_max_gb > 0:
            raise ValueError(f"voice_store_max_gb must be > 0, got {self.voice_store_max_gb}")
        if not self.kv_memory_gb >= 0:
            raise ValueError(f"kv_memory_gb must be >= 0 (0: slots x max_len), got {self.kv_memory_gb}")
        if self.attention not in ("auto", "sdpa", "flashinfer"):
            raise ValueError(f"attention must be auto, sdpa or flashinfer, got {self.attention!r}")
        if self.max_queue < -1:
            raise ValueError(f"max_queue must be >= 0 (or -1 for 4 x slots), got {self.max_queue}")

    @property
    def queue(self) -> int:
        return 4 * self.slots if self.max_queue == -1 else self.max_queue


def _io(inputs, outputs, ragged=()) -> str:
    ins = ",\n  ".join(s.pbtxt(ragged=s.name in ragged) for s in inputs)
    outs = ",\n  ".join(s.pbtxt() for s in outputs)
    return f"input [\n  {ins}\n]\noutput [\n  {outs}\n]\n"


def _params(opts: ServeOptions, **extra) -> str:
    kv = {"checkpoint": opts.checkpoint, "device": opts.device, "run_dir": opts.run_dir,
          **{k: str(v) for k, v in extra.items()}}  # fmt: skip
    return "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in kv.items())


def render(opts: ServeOptions) -> dict[str, str]:
    """model name -> config.pbtxt text."""
    public = int(opts.ensemble)
    header = (
        '# Rendered by serving.repository from serving/contract.py; edit those, not this file.\nbackend: "python"\n'
    )
    tts = (
        f'name: "tts"\n{header}max_batch_size: 0\nmodel_transaction_policy {{ decoupled: true }}\n'
        + _io(C.TTS_INPUTS, C.TTS_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, bls_timeout_seconds=opts.bls_timeout_seconds, cancel_dir=opts.cancel_dir, slots=opts.slots,
                  max_queue=opts.queue)
    )
    prompt = (
        f'name: "prompt_encoder"\n{header}max_batch_size: 8\n'
        + "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        + _io(C.PROMPT_INPUTS, C.PROMPT_OUTPUTS, ragged=("REF_AUDIO",))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, max_anonymous_voices=opts.max_anonymous_voices,
                  voice_store_max_gb=opts.voice_store_max_gb, public_steps=public)
    )
    gen = (
        f'name: "generator"\n{header}max_batch_size: {opts.slots}\nmodel_transaction_policy {{ decoupled: true }}\n'
        + "sequence_batching {\n  iterative_sequence: true\n"
        + f"  oldest {{ max_candidate_sequences: {opts.slots}  max_queue_delay_microseconds: {opts.generator_queue_delay_us} }}\n"
        + "  max_sequence_idle_microseconds: 600000000\n}\n"
        + _io(C.GENERATOR_INPUTS, C.GENERATOR_OUTPUTS, ragged=("PROMPT_LATENTS", "SPEAKER"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, slots=opts.slots, max_len=opts.max_len, kv_memory_gb=opts.kv_memory_gb,
                  attention=opts.attention, cancel_dir=opts.cancel_dir, public_steps=public)
    )
    voc = (
        f'name: "vocoder"\n{header}max_batch_size: {opts.vocoder_batch}\n'
        + f"dynamic_batching {{ max_queue_delay_microseconds: {opts.vocoder_queue_delay_us} }}\n"
        + _io(C.VOCODER_INPUTS, C.VOCODER_OUTPUTS, ragged=("LATENTS", "PROMPT_LATENTS"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, idle_seconds=opts.vocoder_idle_seconds, max_streams=4 * opts.slots + 64,
                  public_steps=public)
    )
    voices = (
        f'name: "voices"\n{header}max_batch_size: 0\n'
        + _io(C.VOICES_INPUTS, C.VOICES_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, bls_timeout_seconds=opts.bls_timeout_seconds)
    )
    models = {"tts": tts, "tts_ensemble": ensemble(), "prompt_encoder": prompt, "generator": gen, "vocoder": voc,
              "voices": voices}  # fmt: skip
    if not opts.ensemble:
        del models["tts_ensemble"]
    return models


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'    {{ model_name: "{model}" model_version: -1\n      ' + "\n      ".join(maps) + " }"


def ensemble() -> str:
    """tts_ensemble: the client's inputs -> prompt_encoder -> generator -> vocoder, outputs of the vocoder.

    The generator's responses carry every vocoder input, so each one becomes one vocoder request; request
    parameters reach the generator as the client sent them.
    """
    given = {s.name for s in C.ENSEMBLE_INPUTS}
    prompt_in = {s.name: s.name for s in C.PROMPT_INPUTS if s.name in given}
    prompt_out = {s.name: f"_{s.name.lower()}" for s in C.PROMPT_OUTPUTS}
    # the generator says what the front end made of TEXT (prompt_encoder's SPOKEN_TEXT and SPOKEN_LANGUAGE)
    prompt_out_for = {**{s.name: prompt_out[s.name] for s in C.VOICE_PROMPT_OUTPUTS},
                      "TEXT": prompt_out["SPOKEN_TEXT"], "LANGUAGE": prompt_out["SPOKEN_LANGUAGE"]}  # fmt: skip
    gen_in = {s.name: prompt_out_for.get(s.name, s.name) for s in C.GENERATOR_INPUTS}
    gen_out = {s.name: f"_gen_{s.name.lower()}" for s in C.GENERATOR_OUTPUTS}
    steps = [
        _step("prompt_encoder", prompt_in, prompt_out),
        _step("generator", gen_in, gen_out),
        _step("vocoder", {s.name: gen_out[s.name] for s in C.VOCODER_INPUTS}, {s.name: s.name for s in C.VOCODER_OUTPUTS}),
    ]  # fmt: skip
    return (
        "# Rendered by serving.repository from serving/contract.py; edit those, not this file.\n"
        'name: "tts_ensemble"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        + _io(C.ENSEMBLE_INPUTS, C.ENSEMBLE_OUTPUTS)
        + "ensemble_scheduling {\n  step [\n"
        + ",\n".join(steps)
        + "\n  ]\n}\n"
    )


def build(dest: Path, opts: ServeOptions) -> Path:
    """Write a complete model repository to ``dest`` (replacing it)."""
    if dest.exists():
        shutil.rmtree(dest)
    for name, text in render(opts).items():
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "config.pbtxt").write_text(text)
        if (SOURCE / name / "1" / "model.py").is_file():  # an ensemble has none
            shutil.copy2(SOURCE / name / "1" / "model.py", dest / name / "1" / "model.py")
    return dest


def main() -> None:
    """Rewrite the committed default configs: ``python -m serving.repository``."""
    for name, text in render(ServeOptions()).items():
        (SOURCE / name / "1").mkdir(parents=True, exist_ok=True)
        (SOURCE / name / "config.pbtxt").write_text(text)


if __name__ == "__main__":
    main()
