"""What each Triton model reads from its ``config.pbtxt`` parameters: one frozen dataclass per model, its fields
the parameters (strings, parsed by the field's type), written by :mod:`serving.config.repository` from
``XOptions.of(serve_options)`` and read in ``initialize`` by ``XOptions.read(args)``; a parameter missing, unknown
or unparsable is a ValueError naming it. No defaults here (ServeOptions' are), and no torch (every stub imports it).
"""

from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Self

if TYPE_CHECKING:
    from serving.config.options import ServeOptions

# The vocoder's stream table holds a stream for every request admission lets in (slots + max_queue: each
# has one stream open at a time, generating or ended with its chunks still on their way through a
# backlogged consumer; read-ahead segments add streams only on free generator slots, so generating streams
# stay within slots), and room besides (a stream whose consumer died waits for reaping).
VOCODER_SPARE_STREAMS = 64
_INTEGER = re.compile(r"-?[0-9]+")


class ModelOptions:
    """A model's options as config parameters and back (the base of the frozen dataclasses below)."""

    MODEL: ClassVar[str] = ""  # the Triton model that reads them, for error messages
    # The fields not named as in ServeOptions, each with how the server's options give it.
    DERIVED: ClassVar[dict] = {  # field -> Callable[[ServeOptions], value]
        "max_queue": lambda opts: opts.queue,  # -1 resolved
        "public_steps": lambda opts: opts.ensemble,  # key-less requests are tts_ensemble's (serving.security.auth)
        "batch_invariant": lambda opts: (
            opts.batch_invariant == "on" or (opts.batch_invariant == "auto" and not opts.device.startswith("cuda"))
        ),  # auto: on for cpu
    }

    @classmethod
    def of(cls, opts: ServeOptions) -> Self:
        """The model's options from the server's: ServeOptions' field of each name, or DERIVED."""
        get = lambda name: cls.DERIVED[name](opts) if name in cls.DERIVED else getattr(opts, name)  # noqa: E731
        return cls(**{f.name: get(f.name) for f in fields(cls)})

    def parameters(self) -> dict[str, str]:
        """Parameter name -> string value, in field order (booleans as 1 or 0)."""
        text = lambda v: ("1" if v else "0") if isinstance(v, bool) else str(v)  # noqa: E731
        return {f.name: text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def read(cls, args_or_params: dict) -> Self:
        """Triton's ``initialize`` args (or the parameters themselves) -> the options."""
        given = dict(args_or_params)
        if "model_config" in given:  # the model config's parameters (name -> string value)
            given = {k: v["string_value"] for k, v in json.loads(given["model_config"]).get("parameters", {}).items()}
        types = typing.get_type_hints(cls)
        values = {}
        for f in fields(cls):
            if f.name not in given:
                raise ValueError(f"{cls.MODEL}: config.pbtxt has no parameter {f.name!r} (render the repository "
                                 "with serving.config.repository)")  # fmt: skip
            values[f.name] = _parse(types[f.name], given.pop(f.name), f"{cls.MODEL} parameter {f.name!r}")
        if given:
            raise ValueError(f"{cls.MODEL}: unknown parameters {sorted(given)} in config.pbtxt; "
                             f"known: {[f.name for f in fields(cls)]}")  # fmt: skip
        return cls(**values)

    @property
    def capacity(self) -> int:
        """Of the models that admit (with slots and max_queue): requests running or waiting at once, tts and
        tts_ensemble together (serving.flow.admission)."""
        return self.slots + self.max_queue


@dataclass(frozen=True)
class TTSOptions(ModelOptions):
    MODEL = "tts"
    checkpoint: str  # the checkpoint folder, for its text tokenizer (empty: $FIRERED_CHECKPOINT)
    run_dir: str  # the launcher's run folder: heartbeats and flags (serving.supervision.run_folder); empty: none
    cancel_dir: str  # cancellation marks (serving.flow.side_channel) and the admission file (serving.flow.admission); empty: its default
    bls_timeout_seconds: int  # every BLS call to prompt_encoder, generator and vocoder
    slots: int  # generator streams stepped together
    max_queue: int  # requests that may wait for a slot beyond the running ones
    start_rate: float  # starts a second the delivery path takes (engine.start_window; 0: no limit)
    tts_instances: int  # tts's stub processes: each gets its share of the start window; text-in needs 1
    models: str  # the release's models served (serving.intake.requests; empty: what the checkpoint holds)
    vocoder_batch: int  # the vocoder's max_batch_size: the most chunks one vocoder request carries
    text_idle_seconds: float  # a text-in stream's longest wait for its next piece (serving.intake.text_streams)
    text_max_seconds: float  # a text-in stream's longest time open, START to END (serving.intake.text_streams)
    pace_hold_seconds: float  # a paced request paused this long with no delivery is ended (serving.flow.pacing)
    read_ahead_cap: int  # most segments of one request generating at once (engine.orchestrator)
    read_ahead_seconds: float  # a request's read-ahead audio not yet sent, before no further segment starts ahead

    def read_ahead(self) -> dict:
        """The orchestrator's read-ahead keywords (engine.orchestrator.Orchestrator)."""
        return {"read_ahead_cap": self.read_ahead_cap, "read_ahead_seconds": self.read_ahead_seconds}


@dataclass(frozen=True)
class PromptEncoderOptions(ModelOptions):
    MODEL = "prompt_encoder"
    checkpoint: str  # the checkpoint folder (empty: $FIRERED_CHECKPOINT)
    device: str  # torch device of the prompt encoder and CAM++
    run_dir: str  # the launcher's run folder (serving.supervision.run_folder); empty: none
    # where the admission file lives (serving.flow.admission), beside the marks; empty: serving.flow.side_channel's default
    cancel_dir: str
    voice_dir: str  # the voice store (empty: serving.voices.voice_store.default_dir())
    max_anonymous_voices: int  # LRU bound of anonymous reference prompts kept on disk
    voice_store_max_gb: float  # bound on the voice store's files (1 GB = 1e9 bytes)
    public_steps: bool  # key-less requests are tts_ensemble's first step (serving.security.auth)
    slots: int  # generator streams stepped together
    max_queue: int  # requests that may wait for a slot beyond the running ones


@dataclass(frozen=True)
class EnsembleGeneratorOptions(ModelOptions):
    MODEL = "ensemble_generator"
    run_dir: str  # the launcher's run folder: heartbeats and flags (serving.supervision.run_folder); empty: none
    cancel_dir: str  # cancellation marks (serving.flow.side_channel) and the admission file (serving.flow.admission); empty: its default
    bls_timeout_seconds: int  # every BLS call to the generator
    slots: int  # generator streams stepped together
    max_queue: int  # requests that may wait for a slot beyond the running ones


@dataclass(frozen=True)
class GeneratorOptions(ModelOptions):
    MODEL = "generator"
    checkpoint: str  # the checkpoint folder (empty: $FIRERED_CHECKPOINT)
    device: str  # torch device of the backbone
    run_dir: str  # the launcher's run folder (serving.supervision.run_folder); empty: none
    cancel_dir: str  # cancellation marks and the live stream list (serving.flow.side_channel); empty: its default
    slots: int  # streams stepped together (batch rows)
    max_len: int  # backbone positions per stream
    kv_memory_gb: float  # the paged KV cache's size in GiB (0: slots x max_len positions)
    attention: str  # attention over the KV cache (engine.layers.attention.ATTENTION_CHOICES)
    batch_invariant: bool  # a stream's bits the same alone or beside others (engine.invariant)
    synthetic_math: bool  # benchmarks only: ready-made latents instead of the model (engine.synthetic)
    synthetic_step: str  # how long a synthetic step lasts (engine.step_cost.StepCost.parse; "": free)
    step_budget_ms: float  # the generator's step budget (engine.step_cost.StepBudget; 0: none)
    models: str  # the release's models to load (serving.intake.requests; empty: what the checkpoint holds)


@dataclass(frozen=True)
class VocoderOptions(ModelOptions):
    MODEL = "vocoder"
    checkpoint: str  # the checkpoint folder (empty: $FIRERED_CHECKPOINT)
    device: str  # torch device of the decoder
    run_dir: str  # the launcher's run folder (serving.supervision.run_folder); empty: none
    cancel_dir: str  # cancellation marks and the live stream list (serving.flow.side_channel); empty: its default
    max_streams: int  # streams holding decoder state at once (slots + queue + VOCODER_SPARE_STREAMS)
    idle_seconds: int  # a stream without a chunk for this long is reclaimed
    batch: int  # chunks decoded together by the engine thread (at least: a request is never split)
    public_steps: bool  # key-less requests are tts_ensemble's last step (serving.security.auth)
    synthetic_math: bool  # benchmarks only: ready-made audio instead of the decoder (engine.synthetic)
    batch_invariant: bool  # a chunk's audio the same bits decoded alone or with others (engine.invariant)
    DERIVED = {**ModelOptions.DERIVED, "max_streams": lambda o: o.slots + o.queue + VOCODER_SPARE_STREAMS,
               "idle_seconds": lambda o: o.vocoder_idle_seconds, "batch": lambda o: o.vocoder_batch}  # fmt: skip


@dataclass(frozen=True)
class VoicesOptions(ModelOptions):
    MODEL = "voices"
    run_dir: str  # the launcher's run folder (serving.supervision.run_folder); empty: none
    voice_dir: str  # the voice store (empty: serving.voices.voice_store.default_dir())
    bls_timeout_seconds: int  # registration's BLS call to prompt_encoder


def _parse(kind: type, text: str, what: str):
    """A parameter's string -> a value of ``kind`` (str, bool, int or float); ValueError naming ``what``."""
    parse = {str: str, bool: {"1": True, "0": False}.get, int: lambda t: _INTEGER.fullmatch(t) and int(t), float: float}
    try:
        value = parse[kind](text)
    except KeyError:
        raise TypeError(f"{what}: no parser for {kind}") from None
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)):
        must = {bool: "1 or 0", int: "an integer", float: "a finite number"}[kind]
        raise ValueError(f"{what} must be {must}, got {text!r}")
    return value
