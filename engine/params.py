"""Request settings, their defaults and their limits, written once (no torch here).

The offline path, the Triton models, the serving contract, the client and the tables in docs/serving.md
all read these; nothing else states a default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.chunking import ChunkSchedule

DEFAULT_SEED = 1234
# patches (160 ms each) in the first audio chunk, and the most in a later one (engine.chunking: bench/chunk_schedule.py
# has the figures for 24 against 12)
DEFAULT_SCHEDULE = ChunkSchedule(3, 24)
DEFAULT_SPLIT_TOKENS = 80  # texts longer than this many tokens are spoken segment by segment


def shown(value) -> str:
    """A client's value for an error message: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit
        return "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Parameter:
    """One request parameter as a client spells it (Triton request parameters; HTTP ``parameters``)."""

    name: str
    type: type  # int, float or bool
    default: int | float | bool
    low: int | float | bool
    high: int | float | bool
    doc: str

    def check(self, value) -> None:
        if not self.low <= value <= self.high:
            raise ValueError(f"{self.name} must be in {self.low}..{self.high}, got {shown(value)}")

    def parse(self, value) -> int | float:
        """A client's value -> the typed value; ValueError naming the parameter otherwise.

        Integers must be integers (``2.7``, ``true`` and ``"3"`` are refused, never truncated); floats
        accept numbers and their decimal text (BLS requests cannot carry floats); booleans must be
        ``true`` or ``false`` (not ``1`` or ``"no"``).
        """
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"parameter {self.name} must be true or false, got {shown(value)}")
            return value
        if self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                raise ValueError(f"parameter {self.name} must be an integer, got {shown(value)}")
        else:
            try:
                ok = not isinstance(value, bool) and math.isfinite(value := float(value))
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise ValueError(f"parameter {self.name} must be a number, got {shown(value)}")
        try:
            self.check(value)
        except ValueError as e:
            raise ValueError(f"parameter {e}") from None
        return value


STEPS = Parameter("steps", int, 10, 1, 100, "Euler steps of the flow head")
CFG = Parameter("cfg", float, 2.0, 0.0, 20.0, "classifier-free guidance weight")
MAX_PATCHES = Parameter("max_patches", int, 400, 1, 4000, "length limit per text segment, in patches (400 = 64 s)")
# The generation parameters a client may give a stream (tts_ensemble takes exactly these) ...
GENERATION_PARAMETERS = (
    STEPS,
    CFG,
    Parameter(
        "chunk_first", int, DEFAULT_SCHEDULE.first, 1, 400,
        "patches (160 ms each) in the first audio chunk, and in a chunk after the listener ran dry",
    ),
    Parameter(
        "chunk_next", int, DEFAULT_SCHEDULE.cap, 1, 400,
        "most patches in a later chunk: later chunks grow up to it while generation runs ahead of "
        "playback and stay small while it does not",
    ),
    Parameter(
        "chunk_fixed", bool, DEFAULT_SCHEDULE.fixed, False, True,
        "true: chunk_next patches in every later chunk, whatever the timing (the schedule before the "
        "deadline rule; it stalls a listener unless generation is chunk_next / chunk_first times real time)",
    ),
    MAX_PATCHES,
)  # fmt: skip
# ... and, from tts only (never a client's), what the listener holds as a later text segment starts
BUFFERED_MS = Parameter("buffered_ms", int, 0, 0, 3_600_000, "milliseconds of audio the listener holds")
GENERATOR_PARAMETERS = (*GENERATION_PARAMETERS, BUFFERED_MS)  # what the generator model reads


@dataclass(frozen=True)
class GenerationParams:
    """Per-request sampling settings (defaults are the reference's; ranges are the parameters' above)."""

    seed: int = DEFAULT_SEED
    steps: int = STEPS.default  # Euler steps of the flow head
    cfg: float = CFG.default  # classifier-free guidance weight w
    stop_threshold: float = 0.5
    min_patches: int = 6  # the stop head is ignored before this many patches
    max_patches: int = MAX_PATCHES.default  # ~64 s

    def __post_init__(self) -> None:
        STEPS.check(self.steps)
        CFG.check(self.cfg)
        MAX_PATCHES.check(self.max_patches)
        if not 0.0 < self.stop_threshold <= 1.0:
            raise ValueError(f"stop_threshold must be in (0, 1], got {self.stop_threshold}")
        if not 0 <= self.min_patches <= self.max_patches:
            raise ValueError(f"need 0 <= min_patches <= max_patches, got {self.min_patches}, {self.max_patches}")
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError("seed must fit in int64")


# ... and the front door adds the text front end (engine.frontend) and the speed (engine.time_stretch).
SPLIT_TOKENS = Parameter(
    "split_tokens", int, DEFAULT_SPLIT_TOKENS, 0, 4096,
    "long texts are spoken in segments of whole sentences grouped up to about this many tokens (characters "
    "for Chinese), joined with a 50 ms cross-fade (0: one segment)",
)  # fmt: skip
NORMALIZE = Parameter(
    "normalize", bool, True, False, True,
    "read numbers, dates, times, currency and symbols out as words (wetext; Chinese, English, Cantonese and "
    "dialects) before speaking",
)  # fmt: skip
SPEED = Parameter(
    "speed", float, 1.0, 0.25, 4.0,
    "speaking rate: 2.0 is twice as fast, 0.5 half as fast, at the same pitch (the audio is time-stretched "
    "as it streams; 1.0 leaves it untouched)",
)  # fmt: skip
READ_AHEAD = Parameter(
    "read_ahead", int, 1, 1, 16,
    "segments of a long text that may generate at once on free generator slots (1: one after another); "
    "the audio is the same, byte for byte (a server in batch-invariant mode too: the default on CPU); a server caps it "
    "(--read-ahead-cap) and lets a "
    "waiting new request go first",
)  # fmt: skip
UTTERANCE_PARAMETERS = (*GENERATION_PARAMETERS, SPLIT_TOKENS, NORMALIZE, SPEED, READ_AHEAD)


def parse_parameters(given: dict | None, known: tuple[Parameter, ...] = UTTERANCE_PARAMETERS) -> dict:
    """Request parameters -> typed values with defaults; unknown names are errors that list the known ones."""
    given = dict(given or {})
    out = {p.name: p.parse(given.pop(p.name)) if p.name in given else p.default for p in known}
    if given:
        raise ValueError(f"unknown request parameters: {sorted(given)}; known: {sorted(p.name for p in known)}")
    return out


def generation_params(seed: int | None, values: dict) -> tuple[GenerationParams, ChunkSchedule]:
    """Parsed parameter values (:func:`parse_parameters`) and a seed -> sampling settings and chunk schedule."""
    gp = GenerationParams(
        seed=DEFAULT_SEED if seed is None else int(seed),
        steps=values["steps"],
        cfg=values["cfg"],
        max_patches=values["max_patches"],
        min_patches=min(GenerationParams.min_patches, values["max_patches"]),  # max_patches < 6 is allowed
    )
    buffered = values.get(BUFFERED_MS.name, 0) / 1000
    return gp, ChunkSchedule(values["chunk_first"], values["chunk_next"], values["chunk_fixed"], buffered)
