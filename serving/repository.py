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
MODELS = ("tts", "tts_ensemble", "prompt_encoder", "ensemble_generator", "generator", "vocoder", "voices")


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
    # Triton frees a sequence's candidate slot this long after its last request. A live stream is back
    # every step (so one generator step must take less than this), while a START that a client cancels
    # while it waits in Triton's queue keeps its slot this long (Triton 2.51 sends no end for it).
    sequence_idle_seconds: int = 30
    vocoder_batch: int = 64  # vocoder chunks decoded together (its engine thread's batch)
    vocoder_queue_delay_us: int = 1000  # how long the vocoder gathers chunks of several streams
    vocoder_idle_seconds: int = 60  # vocoder state without a chunk for this long is reclaimed
    voice_dir: str = ""  # empty: serving.voice_store.default_dir()
    max_anonymous_voices: int = 256  # LRU bound of anonymous reference prompts kept on disk
    voice_store_max_gb: float = 2.0  # bound on the voice store's files (1 GB = 1e9 bytes); named voices are kept
    device: str = "cpu"
    bls_timeout_seconds: int = 120  # every BLS call from tts
    cancel_dir: str = ""  # tts -> generator cancellation marks (default: serving.cancel.default_dir())
    run_dir: str = ""  # the launcher's run folder: heartbeats and flags (serving.supervise); empty: none
    max_queue: int = -1  # tts requests that may wait for a slot beyond the running ones (-1: 4 x slots)
    # Serve tts_ensemble. Its steps cannot carry the internal key, so prompt_encoder, ensemble_generator
    # and the vocoder then also take key-less requests for what the ensemble does (see serving.auth);
    # without it they refuse them. The generator never does.
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
        if not 5 <= self.sequence_idle_seconds <= 3600:
            raise ValueError(f"sequence_idle_seconds must be in 5..3600, got {self.sequence_idle_seconds}")

    @property
    def queue(self) -> int:
        return 4 * self.slots if self.max_queue == -1 else self.max_queue

    @property
    def vocoder_streams(self) -> int:
        """The vocoder's table: every stream the generator can hold, and room for ones ending."""
        return self.slots + 64


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
    admission = {"slots": opts.slots, "max_queue": opts.queue, "cancel_dir": opts.cancel_dir}
    tts = (
        f'name: "tts"\n{header}max_batch_size: 0\nmodel_transaction_policy {{ decoupled: true }}\n'
        + _io(C.TTS_INPUTS, C.TTS_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, bls_timeout_seconds=opts.bls_timeout_seconds, **admission)
    )
    # its queue is bounded: key-less requests (tts_ensemble's first step) are answered here before the gate
    prompt = (
        f'name: "prompt_encoder"\n{header}max_batch_size: 8\n'
        + "dynamic_batching {\n  max_queue_delay_microseconds: 2000\n"
        + f"  default_queue_policy {{ max_queue_size: {2 * (opts.slots + opts.queue)} }}\n}}\n"
        + _io(C.PROMPT_INPUTS, C.PROMPT_OUTPUTS, ragged=("REF_AUDIO",))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, max_anonymous_voices=opts.max_anonymous_voices,
                  voice_store_max_gb=opts.voice_store_max_gb, public_steps=public, **admission)
    )
    ensemble_gen = (
        f'name: "ensemble_generator"\n{header}max_batch_size: 1\nmodel_transaction_policy {{ decoupled: true }}\n'
        + _io(C.GENERATOR_INPUTS, C.GENERATOR_OUTPUTS, ragged=("PROMPT_LATENTS", "SPEAKER"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, bls_timeout_seconds=opts.bls_timeout_seconds, **admission)
    )
    gen = (
        f'name: "generator"\n{header}max_batch_size: {opts.slots}\nmodel_transaction_policy {{ decoupled: true }}\n'
        + "sequence_batching {\n  iterative_sequence: true\n"
        + f"  oldest {{ max_candidate_sequences: {opts.slots}  max_queue_delay_microseconds: {opts.generator_queue_delay_us} }}\n"
        + f"  max_sequence_idle_microseconds: {opts.sequence_idle_seconds * 1_000_000}\n}}\n"
        + _io(C.GENERATOR_INPUTS, C.GENERATOR_OUTPUTS, ragged=("PROMPT_LATENTS", "SPEAKER"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, slots=opts.slots, max_len=opts.max_len, kv_memory_gb=opts.kv_memory_gb,
                  attention=opts.attention, cancel_dir=opts.cancel_dir)
    )
    # decoupled with its own engine thread, not Triton's dynamic batcher: see model_repository/vocoder
    voc = (
        f'name: "vocoder"\n{header}max_batch_size: {opts.vocoder_batch}\n'
        + "model_transaction_policy { decoupled: true }\n"
        + _io(C.VOCODER_INPUTS, C.VOCODER_OUTPUTS, ragged=("LATENTS", "PROMPT_LATENTS"))
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, idle_seconds=opts.vocoder_idle_seconds, max_streams=opts.vocoder_streams,
                  batch=opts.vocoder_batch, queue_delay_us=opts.vocoder_queue_delay_us, cancel_dir=opts.cancel_dir,
                  public_steps=public)
    )
    voices = (
        f'name: "voices"\n{header}max_batch_size: 0\n'
        + _io(C.VOICES_INPUTS, C.VOICES_OUTPUTS)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _params(opts, voice_dir=opts.voice_dir, bls_timeout_seconds=opts.bls_timeout_seconds)
    )
    models = {"tts": tts, "tts_ensemble": ensemble(), "prompt_encoder": prompt, "ensemble_generator": ensemble_gen,
              "generator": gen, "vocoder": voc, "voices": voices}  # fmt: skip
    if not opts.ensemble:
        del models["tts_ensemble"], models["ensemble_generator"]
    return models


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'    {{ model_name: "{model}" model_version: -1\n      ' + "\n      ".join(maps) + " }"


def ensemble() -> str:
    """tts_ensemble: the client's inputs -> prompt_encoder -> ensemble_generator -> vocoder, outputs of the
    vocoder. ensemble_generator runs a generator stream (over BLS, with the internal key) and passes its
    chunks on; they carry every vocoder input, so each one becomes one vocoder request. Request parameters
    reach ensemble_generator as the client sent them.
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
        _step("ensemble_generator", gen_in, gen_out),
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
