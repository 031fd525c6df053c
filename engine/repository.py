"""Render the Triton model repository: ``config.pbtxt`` of each model from :mod:`engine.contract` and
the serving options; ``model.py`` files are copied from ``model_repository/`` as they are.

The committed ``model_repository/*/config.pbtxt`` are this module's output for the default options
(a unit test keeps them in sync), so the folder also works when pointed at directly.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from engine import contract as C

SOURCE = Path(__file__).resolve().parent.parent / "model_repository"
MODELS = ("tts", "prompt_encoder", "generator", "vocoder", "voices")


@dataclass(frozen=True)
class ServeOptions:
    checkpoint: str = ""  # empty: models read $FIRERED_CHECKPOINT
    slots: int = 8  # generator streams stepped together (KV cache rows)
    max_len: int = 2048  # backbone positions per slot (prompt + text + generated patches)
    # How long the sequence batcher waits for rescheduled streams before stepping: with 0 it often
    # stepped a split batch (17 of 63 steps ran one stream alone, small preset, 8 slots); 500 us kept
    # the batch whole at no measurable cost (bench/step_overhead.py).
    generator_queue_delay_us: int = 500
    vocoder_streams: int = 64  # vocoder sequences with live state
    vocoder_idle_seconds: int = 60  # abandoned vocoder state is reclaimed after this
    voice_dir: str = ""  # empty: engine.voice_store.default_dir()
    max_anonymous_voices: int = 256  # LRU bound of anonymous reference prompts kept on disk
    device: str = "cpu"
    bls_timeout_seconds: int = 120  # every BLS call from tts
    cancel_dir: str = ""  # tts -> generator cancellation marks (default: engine.cancel.default_dir())

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 256:
            raise ValueError(f"slots must be in 1..256, got {self.slots}")
        if self.max_len < 64:
            raise ValueError("max_len must be >= 64")


def _io(inputs, outputs, ragged=()) -> str:
    ins = ",\n  ".join(s.pbtxt(ragged=s.name in ragged) for s in inputs)
    outs = ",\n  ".join(s.pbtxt() for s in outputs)
    return f"input [\n  {ins}\n]\noutput [\n  {outs}\n]\n"


def _params(opts: ServeOptions, **extra) -> str:
    kv = {"checkpoint": opts.checkpoint, "device": opts.device, **{k: str(v) for k, v in extra.items()}}
    return "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in kv.items())


def render(opts: ServeOptions) -> dict[str, str]:
    """model name -> config.pbtxt text."""
    header = '# Rendered by engine.repository from engine/contract.py; edit those, not this file.\nbackend: "python"\n'
    tts = (
        f'name: "tts"\n{header}max_batch_size: 0\nmodel_transaction_policy {{ decoupled: true }}\n'
        + _io(C.TTS_INPUTS, C.TTS_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, bls_timeout_seconds=opts.bls_timeout_seconds, cancel_dir=opts.cancel_dir)
    )
    prompt = (
        f'name: "prompt_encoder"\n{header}max_batch_size: 8\n'
        + "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
        + _io(C.PROMPT_INPUTS, C.PROMPT_OUTPUTS, ragged=("REF_AUDIO",))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, max_anonymous_voices=opts.max_anonymous_voices)
    )
    gen = (
        f'name: "generator"\n{header}max_batch_size: {opts.slots}\nmodel_transaction_policy {{ decoupled: true }}\n'
        + "sequence_batching {\n  iterative_sequence: true\n"
        + f"  oldest {{ max_candidate_sequences: {opts.slots}  max_queue_delay_microseconds: {opts.generator_queue_delay_us} }}\n"
        + "  max_sequence_idle_microseconds: 600000000\n}\n"
        + _io(C.GENERATOR_INPUTS, C.GENERATOR_OUTPUTS, ragged=("TOKENS", "PROMPT_LATENTS"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, slots=opts.slots, max_len=opts.max_len, cancel_dir=opts.cancel_dir)
    )
    controls = "\n".join(
        f'    {{ name: "{n}" control [ {{ kind: CONTROL_SEQUENCE_{n} int32_false_true: [ 0, 1 ] }} ] }},'
        for n in C.VOCODER_CONTROLS
    )
    voc = (
        f'name: "vocoder"\n{header}max_batch_size: {opts.vocoder_streams}\n'
        + "sequence_batching {\n"
        + f"  oldest {{ max_candidate_sequences: {opts.vocoder_streams}  max_queue_delay_microseconds: 1000 }}\n"
        + f"  max_sequence_idle_microseconds: {opts.vocoder_idle_seconds * 1_000_000}\n"
        + f"  control_input [\n{controls}\n"
        + '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }\n  ]\n}\n'
        + _io(C.VOCODER_INPUTS, C.VOCODER_OUTPUTS, ragged=("LATENTS", "PROMPT_LATENTS"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, idle_seconds=opts.vocoder_idle_seconds)
    )
    voices = (
        f'name: "voices"\n{header}max_batch_size: 0\n'
        + _io(C.VOICES_INPUTS, C.VOICES_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, bls_timeout_seconds=opts.bls_timeout_seconds)
    )
    return {"tts": tts, "prompt_encoder": prompt, "generator": gen, "vocoder": voc, "voices": voices}


def build(dest: Path, opts: ServeOptions) -> Path:
    """Write a complete model repository to ``dest`` (replacing it)."""
    if dest.exists():
        shutil.rmtree(dest)
    for name, text in render(opts).items():
        (dest / name / "1").mkdir(parents=True)
        (dest / name / "config.pbtxt").write_text(text)
        shutil.copy2(SOURCE / name / "1" / "model.py", dest / name / "1" / "model.py")
    return dest


def main() -> None:
    """Rewrite the committed default configs: ``python -m engine.repository``."""
    for name, text in render(ServeOptions()).items():
        (SOURCE / name / "config.pbtxt").write_text(text)


if __name__ == "__main__":
    main()
