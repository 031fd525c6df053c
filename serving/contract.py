"""Tensors and request parameters crossing Triton: names, dtypes, shapes, defaults and limits, written once.

``config.pbtxt`` files are rendered from these specs (:mod:`serving.config.repository`), the model files,
the BLS calls and the client read and write through them, and a test checks the tables in docs/serving.md
against them (``python -m serving.contract`` prints those tables). Shapes exclude the batch dimension of
models with ``max_batch_size > 0``. Request defaults and limits come from :mod:`engine.params`.
Past 300 lines on purpose: every model's tensors, and what a client's request may carry, in one table
a reader (and the docs' test) can hold side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engine.config import PATCH_SAMPLES, PATCH_SIZE, CoreConfig
from engine.instructions import (
    ACOUSTIC_EDIT,
    ACOUSTIC_TEMPLATES,
    CLONE,
    DESIGN,
    MAX_EDIT_SECONDS,
    MAX_INSTRUCTION_CHARS,
    SEMANTIC_EDIT,
    SPEAK,
    TASK_DEFAULTS,
    TASKS,
)
from engine.params import CFG, DEFAULT_SEED, GENERATION_PARAMETERS, UTTERANCE_PARAMETERS, Parameter
from engine.protocol import (
    CANCELLED,
    ERROR,
    INVALID,
    LATENT_DIM,
    LENGTH,
    MAX_REFERENCE_SECONDS,
    SAMPLE_RATE,
    STOP,
    UNAVAILABLE,
)

# Bounds on the tensors the internal models take, from the contract (no internal model trusts its
# caller's sizes): prompt latents of the longest reference, left-padded to whole patches ...
MAX_PROMPT_LATENTS = -(-int(MAX_REFERENCE_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES) * PATCH_SIZE
# ... the longest chunk a generator stream sends (the largest chunk_first / chunk_next) ...
MAX_CHUNK_LATENTS = PATCH_SIZE * max(p.high for p in GENERATION_PARAMETERS if p.name in ("chunk_first", "chunk_next"))
SPEAKER_DIM = CoreConfig.spk_in_dim  # ... and the CAM++ speaker embedding's size
# ... and the latents of the longest recording an Instruct edit takes (whole patches)
MAX_EDIT_LATENTS = -(-int(MAX_EDIT_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES) * PATCH_SIZE

# What a client's request may carry, checked where it enters (tts, the gateway) by these same values:
# Pacing (serving.flow.pacing): a paced request's token parameter, a pace request's parameters, and what
# every pace request's error message starts with after its kind (a client tells them from its stream's)
PACE, DELIVERED, PACE_REQUEST = "pace", "delivered", "pace request: "
MAX_TEXT_CHARS = 4000  # TEXT (the gateway's ``input``): characters before the front end (long texts: split)
VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # VOICE_ID, the voices model's NAME: safe as a file name
SEED_RANGE = (-(2**63), 2**63 - 1)  # SEED: an int64 (bool is no seed)


def is_seed(value) -> bool:
    """Whether ``value`` is a seed a request may carry: an int (not a bool) in :data:`SEED_RANGE`."""
    return isinstance(value, int) and not isinstance(value, bool) and SEED_RANGE[0] <= value <= SEED_RANGE[1]


# Triton config type -> (datatype on the wire, numpy dtype)
_TYPES = {
    "TYPE_FP32": ("FP32", np.float32),
    "TYPE_INT32": ("INT32", np.int32),
    "TYPE_INT64": ("INT64", np.int64),
    "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_STRING": ("BYTES", np.object_),
}


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # Triton config type, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""

    @property
    def datatype(self) -> str:
        """The wire datatype (``FP32``, ``BYTES``, ...) that clients put in an input."""
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
        parts = [f'name: "{self.name}"', f"data_type: {self.dtype}", f"dims: [ {', '.join(map(str, self.dims))} ]"]
        if self.optional:
            parts.append("optional: true")
        if ragged:
            parts.append("allow_ragged_batch: true")
        return "{ " + "  ".join(parts) + " }"


def text_of(arr) -> str:
    """First element of a BYTES tensor as str (ValueError if it is not UTF-8)."""
    v = np.asarray(arr).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


FINISH_REASONS = (
    f"`{STOP}`, `{LENGTH}`, `{CANCELLED}`, `{INVALID}<message>`, `{UNAVAILABLE}<message>` or `{ERROR}<message>`"
)

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
         f"{MAX_INSTRUCTION_CHARS} characters"),
    Spec("TASK", "TYPE_STRING", (1,), True, f"{', '.join(f'`{t}`' for t in TASKS)}; default `{SPEAK}`"),
    Spec("FLUSH", "TYPE_BOOL", (1,), True,
         "text-in streams (a request with a sequence id): speak the text sent so far now, as its own segment"),
    Spec("RELEASE", "TYPE_STRING", (1,), True,
         "text-in streams, first request: `sentence` (the default: a segment is cut at each sentence end too) or "
         "`flush` (only at `FLUSH` and the end)"),
)  # fmt: skip
# A text-in stream (a client's gRPC sequence to tts: serving.intake.text_streams) holds an admission place only while
# it has text to speak (serving.flow.admission); these bound what a stranger can make one hold, and how many may be open.
# A piece's TEXT has MAX_TEXT_CHARS (serving.intake.requests).
MAX_STREAM_CHARS = 16_000  # text of one stream, all its pieces together (four whole-text requests)
MAX_STREAM_PIECES = 2_000  # requests of one stream
# the longest wait for a stream's next piece (serving.config.options: --text-idle-seconds)
DEFAULT_TEXT_IDLE_SECONDS = 30
# The longest a stream may stay open for text, START to END (--text-max-seconds). An agent opens a stream per turn
# and a turn's text comes in seconds (an LLM writes a reply of a few sentences in 1-10 s); five minutes is a long
# monologue sent at speaking pace. Without it, a piece every idle bound keeps a stream open for MAX_STREAM_PIECES x
# 30 s, about 16 h.
DEFAULT_TEXT_MAX_SECONDS = 300
# Open text streams per admission place (slots + max_queue): the most that one tts holds at once; a START beyond
# them is refused, "unavailable: too many open text streams". A stream holding no place costs a table entry, a queue
# and a coroutine here; four a place lets every place have an agent's next turn open beside the one speaking.
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
TTS_PARAMETERS: tuple[Parameter, ...] = UTTERANCE_PARAMETERS

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
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True),
    Spec("VOICE_ID", "TYPE_STRING", (1,), True),
    Spec("REGISTER_NAME", "TYPE_STRING", (1,), True, "with REF_AUDIO: store the prompt as this named voice"),
    # tts_ensemble's text and language: its front end runs here, in admission work at low priority, not
    # in the generator's batched step (2,000 characters take ~200 ms of wetext). tts sends neither: its
    # orchestrator runs the front end itself. TEXT also keeps a silent-prompt request from being empty
    # (docs/triton.md#T12).
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
# Generation settings arrive as request parameters (GENERATION_PARAMETERS): tts and ensemble_generator
# set them on their BLS requests. ensemble_generator, tts_ensemble's generation step, takes the same
# inputs and sends the same outputs (it passes the generator's chunks on).
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
    Spec(
        "STREAM_ID",
        "TYPE_UINT64",
        (1,),
        doc="the stream's id, issued with a MAC (serving.security.auth); keys the vocoder state",
    ),
    Spec("LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="a chunk of generated latents (may be empty when LAST)"),
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="first response: the prompt latents; then empty"),
    Spec("LAST", "TYPE_BOOL", (1,), doc="the stream's last response"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,), doc=f'"" until LAST, then {FINISH_REASONS}'),
    Spec("SEAL", "TYPE_UINT64", (2,), doc="the chunk's index in its stream and the generator's MAC over the chunk"),
    Spec(
        "TEXT",
        "TYPE_STRING",
        (1,),
        doc='"" but on an Instruct stream\'s plan response (not LAST, no LATENTS), '
        "which never goes to the vocoder: the text it wrote before it speaks",
    ),
)
# A pipe response (serving.stub.chunk_pipe): the chunks of many streams of one reader, packed; the
# generator sends either these or GENERATOR_OUTPUTS in a response, never both.
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

# What clients call, by model name: the inputs they send and the parameters those take.
ENTRY_POINTS: dict[str, tuple[tuple[Spec, ...], tuple[Parameter, ...]]] = {
    "tts": (TTS_INPUTS, TTS_PARAMETERS),
    "tts_ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_PARAMETERS),
    "voices": (VOICES_INPUTS, ()),
}


def input_spec(model: str, name: str) -> Spec:
    """The spec of input ``name`` of a client-facing model (KeyError names what exists)."""
    specs = {s.name: s for s in ENTRY_POINTS[model][0]}
    if name not in specs:
        raise KeyError(f"model {model} has no input {name}; it has {sorted(specs)}")
    return specs[name]


def _shape(spec: Spec) -> str:
    return "[" + ", ".join(map(str, spec.dims)) + "]"


def tensor_table(specs: tuple[Spec, ...], heading: str) -> str:
    """A markdown table of tensors, as the README shows them."""
    rows = [f"| {heading} | type | shape | |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.datatype} | {_shape(s)} | {s.doc} |" for s in specs]
    return "\n".join(rows)


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _range(p: Parameter) -> str:
    return "true, false" if p.type is bool else f"{p.low}..{p.high}"


def parameter_table(params: tuple[Parameter, ...]) -> str:
    rows = ["| parameter | type | default | range | |", "|---|---|---|---|---|"]
    rows += [f"| `{p.name}` | {p.type.__name__} | {_value(p.default)} | {_range(p)} | {p.doc} |" for p in params]
    return "\n".join(rows)


def task_table() -> str:
    """The tasks of ``tts`` as the README shows them, with the defaults a request without SEED / cfg gets."""
    rows = ["| `TASK` | model | needs | refuses | default seed, cfg | |", "|---|---|---|---|---|---|"]
    for task, (model, needs, refuses, what) in TASK_RULES.items():
        defaults = TASK_DEFAULTS.get(task)
        seed_cfg = f"{defaults.seed}, {defaults.cfg}" if defaults else f"{DEFAULT_SEED}, {CFG.default}"
        rows.append(f"| `{task}` | {model} | {needs} | {refuses or '-'} | {seed_cfg} | {what} |")
    return "\n".join(rows)


def acoustic_templates() -> str:
    """The acoustic edits the model knows, one line each."""
    return (
        "\n".join(f"- `{shown}`" for shown in ACOUSTIC_TEMPLATES)
        + f"\n\nEdits take recordings of at most {MAX_EDIT_SECONDS:g} s."
    )


def readme_tables() -> dict[str, str]:
    """The README's contract tables, keyed by the heading of the section that holds them."""
    return {
        "tts inputs": tensor_table(TTS_INPUTS, "input"),
        "tts outputs": tensor_table(TTS_OUTPUTS, "output"),
        "tts tasks": task_table(),
        "acoustic edits": acoustic_templates(),
        "request parameters": parameter_table(TTS_PARAMETERS),
        "tts_ensemble inputs": tensor_table(ENSEMBLE_INPUTS, "input"),
        "tts_ensemble outputs": tensor_table(ENSEMBLE_OUTPUTS, "output"),
    }


if __name__ == "__main__":
    for title, table in readme_tables().items():
        print(f"{title}:\n\n{table}\n")
