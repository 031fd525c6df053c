"""The server's options, written once (:class:`ServeOptions`): a field with ``help`` is a launcher flag
(``--max-len`` for ``max_len``; a :data:`Folder` a path, a ``bool`` ``--flag``/``--no-flag``), the others are set
by the launcher or are tuning constants. What each model reads of them: :mod:`serving.config.model_options`."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NewType

from engine.layers.attention import ATTENTION_CHOICES
from engine.params import READ_AHEAD
from serving.contract import DEFAULT_TEXT_IDLE_SECONDS, DEFAULT_TEXT_MAX_SECONDS

# A folder's path (a str; empty: the default the field's comment names). Its fields' defaults are plain
# strings: ruff's RUF009 cannot tell, hence the noqa on them.
Folder = NewType("Folder", str)
# The most generator slots a server may have. The engine thread steps them all each step (the KV cache's
# size is the real bound: slots x max_len positions unless kv_memory_gb says otherwise).
MAX_SLOTS = 1024
# The most tts instances (stub processes): each reads its own generator pipes (chunk_pipe.MAX_PIPES counts them).
MAX_TTS_INSTANCES = 8


def option(default, help: str, choices: tuple | None = None, low=None, high=None, above=None):
    """A launcher flag's field: its value one of ``choices``, within ``low``..``high``, or over ``above``."""
    return field(default=default, metadata={"help": help, "choices": choices, "range": (low, high, above)})


def _out_of_range(value, low, high, above) -> str | None:
    """What ``value`` is not (``in 1..8``, ``in (0, 60]``, ``>= 0``, ``> 0``), or None: it is in range."""
    if (low is None or value >= low) and (above is None or value > above) and (high is None or value <= high):
        return None
    if high is None:
        return f">= {low}" if above is None else f"> {above}"
    return f"in {low}..{high}" if above is None else f"in ({above}, {high}]"


@dataclass(frozen=True)
class ServeOptions:
    # empty (a config rendered without the launcher): the models read $FIRERED_CHECKPOINT
    checkpoint: Folder = option("", "official-layout checkpoint folder (default: the tiny checkpoint)")  # noqa: RUF009
    slots: int = option(8, "generator streams batched together (KV cache rows)", low=1, high=MAX_SLOTS)
    max_len: int = option(2048, "backbone positions a stream may reach (prompt + text + generated patches)", low=64)
    kv_memory_gb: float = option(0.0, "size of the backbone's paged KV cache in GiB (default 0: slots x max-len "
                                 "positions)", low=0)  # fmt: skip
    attention: str = option("auto", "attention over the KV cache; auto = FlashInfer when usable, else SDPA (the "
                            "log says why)", choices=ATTENTION_CHOICES)  # fmt: skip
    batch_invariant: str = option("auto", "a stream's audio the same bytes whoever shares its batch (a read_ahead "
                                  "text equals read_ahead 1's; off: faster steps, float-close audio; auto: on for "
                                  "cpu, off for cuda, where its cost is not measured; engine/invariant.py)",
                                  choices=("auto", "on", "off"))  # fmt: skip
    vocoder_batch: int = 64  # vocoder chunks decoded together (its engine thread's batch)
    vocoder_idle_seconds: int = 60  # vocoder state without a chunk for this long is reclaimed
    # empty: serving.voices.voice_store.default_dir(), where the launcher's default points too
    voice_dir: Folder = option("", "the voice store (default: ~/.cache/fireredtts3-triton/voices)")  # noqa: RUF009
    max_anonymous_voices: int = option(256, "LRU bound of stored reference prompts")
    voice_store_max_gb: float = option(2.0, "bound on the voice store's files (1 GB = 1e9 bytes); anonymous "
                                       "prompts are evicted to stay under it, named voices are kept", above=0)  # fmt: skip
    device: str = option("cpu", "torch device of the models (cpu, cuda, cuda:1, ...)")
    models: str = option("", "the release's models to serve: base, instruct or base,instruct (default: those the "
                         "checkpoint folder holds)")  # fmt: skip
    bls_timeout_seconds: int = 120  # every BLS call from tts, ensemble_generator and voices
    text_idle_seconds: float = option(float(DEFAULT_TEXT_IDLE_SECONDS), "a text-in stream that sends no text for "
                                      "this long is closed, its place freed", above=0, high=3600)  # fmt: skip
    text_max_seconds: float = option(float(DEFAULT_TEXT_MAX_SECONDS), "a text-in stream still open (no END) this "
                                     "long after its START is closed; send a stream per turn", above=0, high=86400)  # fmt: skip
    # a paced request (serving.flow.pacing) whose client takes no audio this long while it is paused is ended;
    # under bls_timeout_seconds (a paused stream's reader gives up waiting for its next chunk at that)
    pace_hold_seconds: float = option(30.0, "a paced request (request parameter pace) whose client takes no audio "
                                      "for this long while its generation is paused is ended, its slot freed")  # fmt: skip
    cancel_dir: Folder = Folder("")  # tts -> generator cancellation marks (default: flow.side_channel.default_dir())
    run_dir: Folder = Folder("")  # the launcher's run folder: heartbeats, flags (supervision.run_folder); empty: none
    max_queue: int = option(-1, "tts requests that may wait for a slot; more are refused at once, 'server busy' "
                            "(default -1: 4 x slots)", low=-1)  # fmt: skip
    # why: docs/architecture.md, The start window (engine.start_window: the window follows the step)
    start_rate: float = option(96.0, "starts a second the delivery path takes at first: tts's start window (the "
                               "requests between their start and their first audio at once) starts at the larger "
                               "of 32 and this rate x the least time to first audio, then grows while the way out "
                               "stays clear and backs off when it queues or a listener is late, so a burst cannot "
                               "stall streams already playing (0: no limit)", low=0, high=100_000)  # fmt: skip
    # why: docs/architecture.md, The step budget (engine.step_cost.StepBudget)
    step_budget_ms: float = option(128.0, "the generator admits a stream only while its measured step leaves "
                                   "room for it within this many ms (0.8 x the 160 ms a step adds), so every live "
                                   "stream keeps real time; 8 streams are always batched (0: no budget)", low=0, high=10_000)  # fmt: skip
    # tts, the front door, is the first process a GPU-like step saturates (docs/benchmarks.md): N instances are N
    # stub processes, each with its share of the start window; what they share is per run (docs/architecture.md)
    tts_instances: int = option(1, f"tts stub processes (Triton instances of the front door, 1..{MAX_TTS_INSTANCES}); "
                                "text-in streams need 1", low=1, high=MAX_TTS_INSTANCES)  # fmt: skip
    # the request parameter read_ahead: docs/architecture.md, Read-ahead (engine.orchestrator._ReadAhead)
    read_ahead_cap: int = option(4, "most segments of one tts request generating at once, whatever its read_ahead "
                                 "asks (1: one after another)", low=1, high=READ_AHEAD.high)  # fmt: skip
    read_ahead_seconds: float = option(60.0, "a tts request starts no further segment ahead while it holds this "
                                       "much audio made ahead and not yet sent", above=0, high=3600)  # fmt: skip
    # with it the internal models (never the generator) take key-less requests for tts_ensemble's steps, which
    # cannot carry the internal key: docs/architecture.md, Sealing (serving.security.auth)
    ensemble: bool = option(True, "serve tts_ensemble (--no-ensemble: the internal models then refuse every "
                            "request but tts's)")  # fmt: skip
    synthetic_math: bool = option(False, "benchmarks only, no speech: the generator and the vocoder return "
                                  "ready-made latents and audio instead of the model (engine.synthetic)")  # fmt: skip
    synthetic_step: str = option("", "benchmarks only, with --synthetic-math: how long a generator step lasts, "
                                 "FIXED+ROW milliseconds (a step of N streams: FIXED + N x ROW; e.g. 12+0.25) or a "
                                 "GPU-like preset: h100, l4 (default: no time, free math)")  # fmt: skip

    def __post_init__(self) -> None:
        from engine.step_cost import StepCost
        from serving.intake.requests import parse_models

        for ok, problem in [
            (StepCost.parse(self.synthetic_step).free or self.synthetic_math,
             "synthetic_step needs synthetic_math (--synthetic-step times the synthetic generator)"),
            (0 < self.pace_hold_seconds < self.bls_timeout_seconds, f"pace_hold_seconds must be in "
             f"(0, {self.bls_timeout_seconds}) (the BLS timeout), got {self.pace_hold_seconds}"),
        ]:  # fmt: skip
            if not ok:
                raise ValueError(problem)
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
            if f.metadata and (out := _out_of_range(value, *f.metadata["range"])):
                raise ValueError(f"{f.name} must be {out}, got {value}")
        parse_models(self.models)  # ValueError names a model that is not one

    @property
    def queue(self) -> int:
        """Requests that may wait for a slot (``max_queue``, -1 resolved)."""
        return 4 * self.slots if self.max_queue == -1 else self.max_queue


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher flags of :class:`ServeOptions`: every field with help, in field order."""
    types = typing.get_type_hints(ServeOptions)
    for f in fields(ServeOptions):
        if "help" not in f.metadata:
            continue
        kind, default, help = types[f.name], f.default, f.metadata["help"]
        kw: dict = {"dest": f.name} | ({"choices": f.metadata["choices"]} if f.metadata["choices"] else {})
        if kind is bool:
            kw |= {"action": argparse.BooleanOptionalAction, "default": default}
        elif kind is Folder:  # resolved by the launcher: None when not given
            kw |= {"type": Path, "default": None, "metavar": "DIR"}
        else:
            kw |= {"type": kind, "default": default}
            help += "" if "default" in help else f" (default: {default})"
        parser.add_argument("--" + f.name.replace("_", "-"), help=help, **kw)


def from_arguments(args: argparse.Namespace, **resolved) -> ServeOptions:
    """Parsed flags and the fields the launcher ``resolved`` itself (folders) -> ServeOptions (ValueError: out of
    range); a folder neither given nor resolved keeps its default."""
    given = {f.name: getattr(args, f.name) for f in fields(ServeOptions) if "help" in f.metadata}
    values = {name: str(v) if isinstance(v, Path) else v for name, v in given.items() if v is not None}
    return ServeOptions(**(values | resolved))
