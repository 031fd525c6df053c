"""Tensors and request parameters crossing Triton (names, dtypes, shapes without a batched model's batch dimension,
limits), written once: configs are rendered from them and docs/serving.md's tables checked against them; and the one
encoding of a generator stream's settings (:func:`encode_settings`). Defaults and limits: :mod:`engine.params`."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engine import instructions as _i
from engine import params as _ep
from engine import protocol as _p
from engine.chunking import ChunkSchedule
from engine.config import PATCH_SAMPLES, PATCH_SIZE, CoreConfig
from engine.instructions import ACOUSTIC_EDIT, CLONE, DESIGN, SEMANTIC_EDIT, SPEAK, TASK_DEFAULTS
from engine.params import DEFAULT_SEED, GENERATION_PARAMETERS, GenerationParams, Parameter
from engine.protocol import LATENT_DIM, LENGTH, MAX_REFERENCE_SECONDS, SAMPLE_RATE, STOP

# Bounds on the tensors the internal models take (none trusts its caller's sizes): prompt latents of the
# longest reference and of the longest recording an Instruct edit takes, left-padded to whole patches, the
# longest chunk a generator stream sends (the largest chunk_first / chunk_next), the CAM++ embedding's size.
MAX_PROMPT_LATENTS = -(-int(MAX_REFERENCE_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES) * PATCH_SIZE
MAX_EDIT_LATENTS = -(-int(_i.MAX_EDIT_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES) * PATCH_SIZE
MAX_CHUNK_LATENTS = PATCH_SIZE * max(p.high for p in GENERATION_PARAMETERS if p.name in ("chunk_first", "chunk_next"))
SPEAKER_DIM = CoreConfig.spk_in_dim

# What a client's request may carry, checked where it enters (tts, the gateway) by these same values.
# Pacing (serving.flow.pacing): a paced request's token parameter, a pace request's parameters, and what
# every pace request's error message starts with after its kind (a client tells them from its stream's).
PACE, DELIVERED, PACE_REQUEST = "pace", "delivered", "pace request: "
MAX_TEXT_CHARS = 4000  # TEXT (the gateway's ``input``): characters before the front end (long texts: split)
VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # VOICE_ID, the voices model's NAME: safe as a file name
SEED_RANGE = (-(2**63), 2**63 - 1)  # SEED: an int64 (bool is no seed)


def is_seed(value) -> bool:
    """An int (not a bool) in :data:`SEED_RANGE`."""
    return isinstance(value, int) and not isinstance(value, bool) and SEED_RANGE[0] <= value <= SEED_RANGE[1]


def check_seed(seed) -> int | None:
    """A SEED (:func:`is_seed`), or None when absent; ValueError otherwise."""
    if seed is not None and not is_seed(seed):
        raise ValueError(f"SEED must be an int64, got {seed!r}")
    return seed


# Triton config type -> (datatype on the wire, numpy dtype)
_TYPES = {"TYPE_FP32": ("FP32", np.float32), "TYPE_INT32": ("INT32", np.int32), "TYPE_INT64": ("INT64", np.int64),
          "TYPE_UINT64": ("UINT64", np.uint64), "TYPE_BOOL": ("BOOL", np.bool_),
          "TYPE_STRING": ("BYTES", np.object_)}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # Triton config type, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""

    @property
    def datatype(self) -> str:  # on the wire: FP32, BYTES, ...
        return _TYPES[self.dtype][0]

    @property
    def numpy_dtype(self):
        return _TYPES[self.dtype][1]

    def array(self, value) -> np.ndarray:
        """``value`` as this tensor (strings UTF-8 encoded; a -1 dim takes the value's length)."""
        if self.dtype == "TYPE_STRING":
            arr = np.array([str(value).encode("utf-8")], np.object_)
        else:
            arr = np.asarray(value, self.numpy_dtype).reshape(-1)
        return arr.reshape(self.dims)

    def pbtxt(self, ragged: bool = False) -> str:
        parts = [f'name: "{self.name}"', f"data_type: {self.dtype}", f"dims: [ {', '.join(map(str, self.dims))} ]",
                 *(["optional: true"] if self.optional else []), *(["allow_ragged_batch: true"] if ragged else [])]  # fmt: skip
        return "{ " + "  ".join(parts) + " }"


def text_of(arr) -> str:
    """First element of a BYTES tensor as str (ValueError if it is not UTF-8)."""
    v = np.asarray(arr).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


FINISH_REASONS = (f"`{STOP}`, `{LENGTH}`, `{_p.CANCELLED}`, `{_p.INVALID}<message>`, `{_p.UNAVAILABLE}<message>` or "
                  f"`{_p.ERROR}<message>`")  # fmt: skip

DEFAULT_RELEASE = "sentence"  # a text-in stream's segments: cut at sentence ends too (engine.frontend.text_in)

# ---- tts: the public front door (decoupled, BLS orchestration, max_batch_size 0) ----
# What Base takes (tts_ensemble takes exactly these) ...
BASE_INPUTS = (
    Spec("TEXT", "TYPE_STRING", (1,), doc="text to speak (UTF-8), required"),
    Spec("LANGUAGE", "TYPE_STRING", (1,), True,
         "one of the 24 languages or 21 `ZH_*` dialects; detected from the text when absent or `auto`"),
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True, "reference voice, mono samples in [-1, 1]"),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True, "sample rate of `REF_AUDIO` in Hz (required with it)"),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True, "transcript of `REF_AUDIO`"),
    Spec("VOICE_ID", "TYPE_STRING", (1,), True, "a registered voice (instead of `REF_AUDIO`)"),
    Spec("SEED", "TYPE_INT64", (1,), True, f"sampling seed, default {DEFAULT_SEED}"),
)  # fmt: skip
_TASK_SEEDS = "; ".join(f"{d.seed} for `{task}`" for task, d in TASK_DEFAULTS.items() if d.seed != DEFAULT_SEED)
# ... and what tts takes besides: FireRedTTS3-Instruct's tasks (the tasks table below).
_TTS_DOCS = {
    "TEXT": "text to speak (UTF-8); required for every `TASK` but the edits, which take none",
    "REF_AUDIO": "reference voice (or, for the edits, the recording to edit), mono samples in [-1, 1]",
    "SEED": f"sampling seed, default {DEFAULT_SEED}; {_TASK_SEEDS} (the tasks table)",
}
TTS_INPUTS = (
    *(Spec(s.name, s.dtype, s.dims, True, _TTS_DOCS.get(s.name, s.doc)) for s in BASE_INPUTS),
    Spec("INSTRUCTION", "TYPE_STRING", (1,), True,
         f"a voice description (voice design: with `TEXT` and no voice) or the edit's instruction; at most "
         f"{_i.MAX_INSTRUCTION_CHARS} characters"),
    Spec("TASK", "TYPE_STRING", (1,), True, f"{', '.join(f'`{t}`' for t in _i.TASKS)}; default `{SPEAK}`"),
    Spec("FLUSH", "TYPE_BOOL", (1,), True,
         "text-in streams (a request with a sequence id): speak the text sent so far now, as its own segment"),
    Spec("RELEASE", "TYPE_STRING", (1,), True,
         "text-in streams, first request: `sentence` (the default: a segment is cut at each sentence end too) or "
         "`flush` (only at `FLUSH` and the end)"),
)  # fmt: skip
# Text-in streams (serving.intake.text_streams; why these values: docs/serving.md "Bounds", docs/architecture.md's
# limits table): text and requests of one stream, the idle and lifetime bounds' defaults (--text-idle-seconds,
# --text-max-seconds: an agent's turn comes in seconds; without it a piece every 30 s kept a stream ~16 h), and the
# open streams per admission place (an agent's next turn open beside the one speaking, a table entry each).
MAX_STREAM_CHARS, MAX_STREAM_PIECES = 16_000, 2_000
DEFAULT_TEXT_IDLE_SECONDS, DEFAULT_TEXT_MAX_SECONDS = 30, 300
TEXT_STREAMS_PER_PLACE = 4
TTS_OUTPUTS = (
    Spec("AUDIO", "TYPE_FP32", (-1,), doc="mono 24 kHz samples; one chunk per response, in order"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,),
         doc=f"final response only: `{STOP}` (the model ended the utterance) or `{LENGTH}` (cut at `max_patches`)"),
    Spec("PLAN_TEXT", "TYPE_STRING", (1,),
         doc=f"`{DESIGN}` and `{SEMANTIC_EDIT}` only: the voice-attribute plan / the rewritten transcript, once, in "
             "its own response (no `AUDIO`) before the first audio"),
    Spec("FLUSHED", "TYPE_INT32", (1,),
         doc="text-in streams: n, in its own response (no `AUDIO`), once the audio of the text up to the n-th "
             "`FLUSH` has been sent (but its last 50 ms, which are cross-faded into what follows)"),
)  # fmt: skip
# How TASK, INSTRUCTION, TEXT and the voice combine (serving.intake.requests.instruct_request checks it):
# task -> (which model, what it needs, what it refuses, what it does)
TASK_RULES = {
    SPEAK: ("Base", "`TEXT`", "",
            "clone `REF_AUDIO` / `VOICE_ID` (or speak with no voice); with `INSTRUCTION` and no voice: `design`"),
    CLONE: ("Instruct", "`TEXT`, `REF_AUDIO` or `VOICE_ID`", "`INSTRUCTION`", "Instruct cloning of the voice"),
    DESIGN: ("Instruct", "`TEXT`, `INSTRUCTION`", "`REF_AUDIO`, `VOICE_ID`, `REF_TEXT`",
             "a new voice from the description; `PLAN_TEXT`: the voice attributes it worked out"),
    SEMANTIC_EDIT: ("Instruct", "`REF_AUDIO` (the recording), `INSTRUCTION`", "`TEXT`, `VOICE_ID`, `REF_TEXT`",
                    "change the recording's words; `PLAN_TEXT`: the rewritten transcript"),
    ACOUSTIC_EDIT: ("Instruct", "`REF_AUDIO` (the recording), `INSTRUCTION` from the templates",
                    "`TEXT`, `VOICE_ID`, `REF_TEXT`", "change the recording's speed, pitch or volume"),
}  # fmt: skip
TTS_PARAMETERS: tuple[Parameter, ...] = _ep.UTTERANCE_PARAMETERS

# ---- tts_ensemble: prompt_encoder -> generator -> vocoder as a Triton ensemble (max_batch_size 0) ----
# Its steps are batched models, so each tensor has the leading batch dimension of 1 written out.
ENSEMBLE_INPUTS = tuple(Spec(s.name, s.dtype, (1, *s.dims), s.optional, s.doc) for s in BASE_INPUTS)
ENSEMBLE_OUTPUTS = (
    Spec("AUDIO", "TYPE_FP32", (-1, -1), doc="(1, n) mono 24 kHz samples; one chunk per response, in order"),
    Spec("FINISH_REASON", "TYPE_STRING", (-1, 1), doc=f'"" until the last response, then {FINISH_REASONS}'),
)
# one segment (no split_tokens); the front end always normalizes (in prompt_encoder)
ENSEMBLE_PARAMETERS: tuple[Parameter, ...] = GENERATION_PARAMETERS

# ---- prompt_encoder (dynamic batching) ----
PROMPT_INPUTS = (
    *(Spec(s.name, s.dtype, s.dims, True) for s in BASE_INPUTS[2:6]),  # REF_AUDIO, its rate, REF_TEXT, VOICE_ID
    Spec("REGISTER_NAME", "TYPE_STRING", (1,), True, "with REF_AUDIO: store the prompt as this named voice"),
    # tts_ensemble's text and language: its front end runs here, in admission work at low priority, not in the
    # generator's batched step (2,000 characters take ~200 ms of wetext). tts sends neither: its orchestrator
    # runs the front end itself. TEXT also keeps a silent-prompt request from being empty (docs/triton.md#T12).
    Spec("TEXT", "TYPE_STRING", (1,), True, "the text to speak: cleaned and normalized into SPOKEN_TEXT"),
    Spec("LANGUAGE", "TYPE_STRING", (1,), True, "with TEXT; detected when absent or auto"),
)
VOICE_PROMPT_OUTPUTS = (
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="RedAE latents of the padded reference (4 per patch)"),
    Spec("SPEAKER", "TYPE_FP32", (-1,), doc="CAM++ speaker embedding"),
    Spec("PROMPT_TEXT", "TYPE_STRING", (1,), doc="transcript that goes before the text"),
)
SPOKEN_OUTPUTS = (  # what the generator is asked to say, for tts_ensemble ("" without TEXT)
    Spec("SPOKEN_TEXT", "TYPE_STRING", (1,), doc="TEXT through the front end, as one segment"),
    Spec("SPOKEN_LANGUAGE", "TYPE_STRING", (1,), doc="LANGUAGE, or the language detected in TEXT"),
)
PROMPT_OUTPUTS = VOICE_PROMPT_OUTPUTS + SPOKEN_OUTPUTS

# ---- generator (decoupled, its own engine thread; one request = one stream; internal key only) ----
# ensemble_generator, tts_ensemble's generation step, takes the same inputs and sends the same outputs (it
# passes the generator's chunks on). A stream's settings cross as SEED and request parameters: see below.
GENERATOR_INPUTS = (
    Spec("TEXT", "TYPE_STRING", (1,), doc="one text segment"),
    Spec("LANGUAGE", "TYPE_STRING", (1,), True),
    Spec("SEED", "TYPE_INT64", (1,), True),
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM)),
    Spec("SPEAKER", "TYPE_FP32", (-1,)),
    Spec("PROMPT_TEXT", "TYPE_STRING", (1,)),
    # FireRedTTS3-Instruct: absent or "" = Base. The prompt tensors are then the cloning prompt (clone) or
    # the recording to edit (edits), empty for design; SPEAKER is not read.
    Spec("TASK", "TYPE_STRING", (1,), True),
    Spec("INSTRUCTION", "TYPE_STRING", (1,), True),
)
# Every response carries all the vocoder's inputs (engine.protocol.Chunk), so that an ensemble can
# feed it straight on; a failed stream ends with a normal last response whose reason says why.
GENERATOR_OUTPUTS = (
    Spec("STREAM_ID", "TYPE_UINT64", (1,),
         doc="the stream's id, issued with a MAC (serving.security.auth); keys the vocoder state"),
    Spec("LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="a chunk of generated latents (may be empty when LAST)"),
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="first response: the prompt latents; then empty"),
    Spec("LAST", "TYPE_BOOL", (1,), doc="the stream's last response"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,), doc=f'"" until LAST, then {FINISH_REASONS}'),
    Spec("SEAL", "TYPE_UINT64", (2,), doc="the chunk's index in its stream and the generator's MAC over the chunk"),
    Spec("TEXT", "TYPE_STRING", (1,), doc='"" but on an Instruct stream\'s plan response (not LAST, no LATENTS), '
         "which never goes to the vocoder: the text it wrote before it speaks"),
)  # fmt: skip


# A generator stream's settings (GenerationParams, ChunkSchedule), tts and ensemble_generator -> generator, encoded
# once: the seed as SEED, the rest as request parameters (GENERATOR_PARAMETERS), cfg as its exact text (BLS requests
# refuse floats: docs/triton.md#T11), what the listener holds (a later text segment's) as whole milliseconds.
def encode_settings(params: GenerationParams, schedule: ChunkSchedule) -> tuple[int, dict[str, int | str | bool]]:
    """-> (SEED, request parameters) of a generator stream, which :func:`decode_settings` reads back."""
    given = {"steps": params.steps, "cfg": repr(params.cfg), "max_patches": params.max_patches,
             "chunk_first": schedule.first, "chunk_next": schedule.cap, "chunk_fixed": schedule.fixed}  # fmt: skip
    buffered_ms = min(int(schedule.buffered * 1000), _ep.BUFFERED_MS.high)
    return params.seed, given | {_ep.BUFFERED_MS.name: buffered_ms} if buffered_ms else given


def decode_settings(seed, parameters: dict, known: tuple[Parameter, ...] = _ep.GENERATOR_PARAMETERS):
    """SEED and request parameters -> (GenerationParams, ChunkSchedule); ValueError naming the one at fault. The
    generator reads :func:`encode_settings`' this way, ensemble_generator its client's (``known``:
    ENSEMBLE_PARAMETERS, the names a client may send). An absent one is its default."""
    return _ep.generation_params(check_seed(seed), _ep.parse_parameters(parameters, known))


# A pipe response (serving.stub.chunk_pipe): the chunks of many streams of one reader, packed; the
# generator sends every response so (a stream's own request's refusal too).
PIPE_COLUMNS = 6
PIPE_OUTPUTS = (
    Spec("PIPE_CHUNKS", "TYPE_UINT64", (-1, PIPE_COLUMNS),
         doc="per chunk: STREAM_ID, its SEAL (index, MAC), its LATENTS rows, its PROMPT_LATENTS rows, LAST"),
    Spec("PIPE_LATENTS", "TYPE_FP32", (-1, LATENT_DIM),
         doc="per chunk in order: its LATENTS rows, then its PROMPT_LATENTS rows"),
    Spec("PIPE_TEXT", "TYPE_STRING", (-1, 2), doc="per chunk: its FINISH_REASON and its TEXT"),
)  # fmt: skip

# ---- vocoder (decoupled, its own engine thread, one instance, state per STREAM_ID) ----
# A request is a batch of 1..max_batch_size chunks (rows), one final response answers all of them: the
# ensemble sends each generator response as it comes (1 row); tts sends the chunks of many streams that
# are due together (serving.stub.vocoder_batch), rows of equal LATENTS and PROMPT_LATENTS lengths.
VOCODER_INPUTS = tuple(s for s in GENERATOR_OUTPUTS if s.name != "TEXT")  # plan text never reaches the vocoder
VOCODER_OUTPUTS = (
    Spec("AUDIO", "TYPE_FP32", (-1,), doc="samples finished by this chunk, then zeros up to the batch's longest"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,), doc="the chunk's FINISH_REASON, passed on, or why it was refused"),
    Spec("SAMPLES", "TYPE_INT32", (1,), doc="how many of the row's AUDIO values are the chunk's"),
)
# what tts_ensemble streams of the vocoder's outputs (a row is a whole chunk there: no SAMPLES)
VOCODER_ENSEMBLE_OUTPUTS = tuple(s for s in VOCODER_OUTPUTS if s.name in {e.name for e in ENSEMBLE_OUTPUTS})

# ---- voices (named voice management; max_batch_size 0) ----
VOICES_INPUTS = (
    Spec("ACTION", "TYPE_STRING", (1,), doc="add | list | remove | check (the admin key only)"),
    Spec("NAME", "TYPE_STRING", (1,), True, f"voice name, {VOICE_NAME.pattern}"),
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True, "with add: the reference clip"),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True),
)
VOICES_OUTPUTS = (Spec("RESULT", "TYPE_STRING", (1,), doc="JSON: the voice (add, remove) or the list of voices"),)


def input_spec(model: str, name: str) -> Spec:
    """The spec of input ``name`` of a client-facing model (KeyError names what exists)."""
    specs = {s.name: s for s in {"tts": TTS_INPUTS, "tts_ensemble": ENSEMBLE_INPUTS, "voices": VOICES_INPUTS}[model]}
    if name not in specs:
        raise KeyError(f"model {model} has no input {name}; it has {sorted(specs)}")
    return specs[name]
