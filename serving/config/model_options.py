"""What each Triton model reads from its ``config.pbtxt`` parameters: one frozen dataclass per model, its fields
the parameters (strings, parsed by the field's type), written by :mod:`serving.config.repository` from
``XOptions.of(serve_options)`` and read in ``initialize`` by ``XOptions.read(args)``; a parameter missing, unknown
or unparsable is a ValueError naming it. No defaults here (ServeOptions' are), and no torch (every stub imports it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import fields
from typing import TYPE_CHECKING, ClassVar, Self

if TYPE_CHECKING:
    from serving.config.options import ServeOptions

# The vocoder's stream table holds a stream for every request admission lets in (slots + max_queue: each
# has one stream open at a time, generating or ended with its chunks still on their way through a
# backlogged consumer; read-ahead segments add streams only on free generator slots, so generating streams
# stay within slots), and room besides (a stream whose consumer died waits for reaping).
VOCODER_SPARE_STREAMS = 64
_INTEGER = re.compile(r"-?[0-9]+")


# Each parameter's type (ServeOptions' for a field of its name, but batch_invariant: resolved here).
TYPES = {name: kind for kind, names in [
    (str, "checkpoint device run_dir cancel_dir voice_dir attention models synthetic_step"),
    (int, "slots max_len max_queue tts_instances bls_timeout_seconds vocoder_batch read_ahead_cap max_anonymous_voices "
          "max_streams idle_seconds batch"),
    (float, "kv_memory_gb start_rate text_idle_seconds text_max_seconds pace_hold_seconds read_ahead_seconds "
            "voice_store_max_gb step_budget_ms"),
    (bool, "public_steps batch_invariant synthetic_math"),
] for name in names.split()}  # fmt: skip


class ModelOptions:
    """A model's options as config parameters and back: the base of the frozen dataclasses :func:`_model` makes
    below, each field the ServeOptions field of its name (what it means: there) or DERIVED."""

    MODEL: ClassVar[str] = ""  # the Triton model that reads them, for error messages
    # The fields not named as in ServeOptions, each with how the server's options give it.
    DERIVED: ClassVar[dict] = {  # field -> Callable[[ServeOptions], value]
        "max_queue": lambda opts: opts.queue,  # -1 resolved
        "public_steps": lambda opts: opts.ensemble,  # key-less requests are tts_ensemble's (serving.security.auth)
        "batch_invariant": lambda opts: (
            opts.batch_invariant == "on" or (opts.batch_invariant == "auto" and not opts.device.startswith("cuda"))
        ),  # auto: on for cpu
        # the vocoder's: streams holding decoder state at once; a stream idle this long is reclaimed; chunks its
        # engine thread decodes together (at least: a request is never split)
        "max_streams": lambda opts: opts.slots + opts.queue + VOCODER_SPARE_STREAMS,
        "idle_seconds": lambda opts: opts.vocoder_idle_seconds,
        "batch": lambda opts: opts.vocoder_batch,
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
    def read(cls, args: dict) -> Self:
        """Triton's ``initialize`` args -> the options."""
        given = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        values = {}
        for f in fields(cls):
            if f.name not in given:
                raise ValueError(f"{cls.MODEL}: config.pbtxt has no parameter {f.name!r} (render the repository "
                                 "with serving.config.repository)")  # fmt: skip
            values[f.name] = _parse(TYPES[f.name], given.pop(f.name), f"{cls.MODEL} parameter {f.name!r}")
        if given:
            raise ValueError(f"{cls.MODEL}: unknown parameters {sorted(given)} in config.pbtxt; "
                             f"known: {[f.name for f in fields(cls)]}")  # fmt: skip
        return cls(**values)

    @property
    def capacity(self) -> int:
        """Of the models that admit (with slots and max_queue): requests running or waiting at once, tts and
        tts_ensemble together (serving.flow.admission)."""
        return self.slots + self.max_queue


def _model(cls: str, model: str, names: str, **namespace) -> type[ModelOptions]:
    """The frozen dataclass ``cls`` of ``model``'s options: the parameters ``names`` (their types: TYPES)."""
    return dataclasses.make_dataclass(cls, [(name, TYPES[name]) for name in names.split()], bases=(ModelOptions,),
                                      frozen=True, namespace={"MODEL": model, "__module__": __name__, **namespace})  # fmt: skip


# run_dir: heartbeats and flags (serving.supervision.run_folder); cancel_dir: cancellation marks, the live stream
# list (serving.flow.side_channel) and the admission file (serving.flow.admission); empty: none / their default.
# tts's vocoder_batch: the vocoder's max_batch_size, the most chunks one of its vocoder requests carries.
TTSOptions = _model("TTSOptions", "tts", "checkpoint run_dir cancel_dir bls_timeout_seconds slots max_queue start_rate "
                    "tts_instances models vocoder_batch text_idle_seconds text_max_seconds pace_hold_seconds "
                    "read_ahead_cap read_ahead_seconds", read_ahead=lambda self: {  # the orchestrator's keywords
                        "read_ahead_cap": self.read_ahead_cap, "read_ahead_seconds": self.read_ahead_seconds})  # fmt: skip
PromptEncoderOptions = _model("PromptEncoderOptions", "prompt_encoder", "checkpoint device run_dir cancel_dir "
                              "voice_dir max_anonymous_voices voice_store_max_gb public_steps slots max_queue")  # fmt: skip
EnsembleGeneratorOptions = _model("EnsembleGeneratorOptions", "ensemble_generator",
                                  "run_dir cancel_dir bls_timeout_seconds slots max_queue")  # fmt: skip
GeneratorOptions = _model("GeneratorOptions", "generator", "checkpoint device run_dir cancel_dir slots max_len "
                          "kv_memory_gb attention batch_invariant synthetic_math synthetic_step step_budget_ms models")  # fmt: skip
VocoderOptions = _model("VocoderOptions", "vocoder", "checkpoint device run_dir cancel_dir max_streams idle_seconds "
                        "batch public_steps synthetic_math batch_invariant")  # fmt: skip
VoicesOptions = _model("VoicesOptions", "voices", "run_dir voice_dir bls_timeout_seconds")


def _parse(kind: type, text: str, what: str):
    """A parameter's string -> a value of ``kind`` (str, bool, int or float); ValueError naming ``what``."""
    parse = {str: str, bool: {"1": True, "0": False}.get, int: lambda t: _INTEGER.fullmatch(t) and int(t), float: float}
    try:
        value = parse[kind](text)
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)):
        must = {bool: "1 or 0", int: "an integer", float: "a finite number"}[kind]
        raise ValueError(f"{what} must be {must}, got {text!r}")
    return value
