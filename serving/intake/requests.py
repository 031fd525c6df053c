"""A ``tts`` request checked once, where it enters: :func:`parse_request` turns :class:`TTSInputs` into a
frozen :class:`SpeechRequest` that nothing after it checks again; and the checks the other entry points share.
Every error is a ValueError naming the input or parameter as the client spelled it. No Triton here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine import instructions
from engine.audio import check_reference
from engine.frontend.cleaning import clean
from engine.instructions import CLONE, DESIGN, EDITS, MAX_EDIT_SECONDS, SPEAK, TASK_DEFAULTS, TASKS
from engine.orchestrator import Utterance
from engine.params import generation_params, parse_parameters, shown
from engine.text import canonical_language
from serving.contract import MAX_TEXT_CHARS, PACE, TTS_PARAMETERS, VOICE_NAME, check_seed
from serving.security.auth import parameter_dict


@dataclass(frozen=True)
class TTSInputs:
    """A ``tts`` request's inputs (TEXT, LANGUAGE, ...; a text-in stream's TEXT is ``text_streams.STREAMED``)
    and parameters (JSON text inside the stub) as they came, unchecked: absent is "", None or 0."""

    text: str | None = ""
    language: str | None = ""
    ref_audio: np.ndarray | None = None
    ref_sample_rate: int | None = 0  # Hz
    ref_text: str | None = ""
    voice_id: str | None = ""
    seed: int | None = None
    parameters: str | dict | None = None
    task: str | None = ""  # "" or "speak": Base, unless INSTRUCTION is given
    instruction: str | None = ""


@dataclass(frozen=True)
class Voice:
    """The voice a request asks for: a reference clip, a registered name, or neither (silent prompt)."""

    ref_audio: np.ndarray | None = None  # (n,) float32 in [-1, 1]
    ref_sample_rate: int = 0
    ref_text: str = ""
    voice_id: str = ""


def check_language(language: str | None) -> str | None:
    """A LANGUAGE: a language or dialect name in its canonical spelling; None when absent or ``auto`` (detect it)."""
    if not isinstance(language, str | None):
        raise ValueError(f"LANGUAGE must be a string, got {type(language).__name__}")
    if language is None or language.strip().lower() in ("", "auto"):
        return None
    try:
        return canonical_language(language)
    except ValueError as e:
        raise ValueError(f"LANGUAGE: {e}") from None


def check_text(text: str | None, field: str = "TEXT", required: bool = True, limit: int = MAX_TEXT_CHARS) -> str:
    """A text field (TEXT, REF_TEXT, PROMPT_TEXT): its size, and no control token of the tokenizer
    (:func:`engine.instructions.control_token_error`), as sent or once cleaned (cleaning strips a zero-width
    space inside one, and it re-forms)."""
    if not isinstance(text, str) or (required and not text.strip()):
        raise ValueError(f"{field} must be a non-empty string")
    if len(text) > limit:
        raise ValueError(f"{field} is {len(text)} characters; the limit is {limit} (split long texts)")
    problem = instructions.control_token_error(text) or instructions.control_token_error(clean(text))
    if problem:
        raise ValueError(f"{field} {problem}")
    return text


def check_name(name: str, field: str = "NAME") -> str:
    """A voice name (:data:`serving.contract.VOICE_NAME`), safe as a file name."""
    if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
        raise ValueError(f"{field}: voice name must match {VOICE_NAME.pattern}, got {name!r}")
    return name


def check_ref_audio(audio: np.ndarray, sample_rate) -> tuple[np.ndarray, int]:
    """REF_AUDIO ([n] or [1, n]) and REF_SAMPLE_RATE -> (float32 (n,), rate), by :func:`engine.audio.check_reference`."""
    audio = check_reference(np.asarray(audio).reshape(-1), sample_rate, "REF_AUDIO", "REF_SAMPLE_RATE")
    return audio, int(sample_rate)


def check_voice(ref_audio, ref_sample_rate, ref_text: str | None, voice_id: str | None) -> Voice:
    """A request's voice, checked the same way wherever it enters (tts, and prompt_encoder without the key):
    REF_AUDIO with REF_SAMPLE_RATE (and REF_TEXT, its transcript), or VOICE_ID, or neither (the default voice)."""
    ref_text = check_text(ref_text or "", "REF_TEXT", required=False)
    if ref_audio is not None:
        if voice_id:
            raise ValueError("give either REF_AUDIO or VOICE_ID, not both")
        return Voice(*check_ref_audio(ref_audio, ref_sample_rate), ref_text)
    if ref_text:
        raise ValueError("REF_TEXT was given without REF_AUDIO")
    if ref_sample_rate:
        raise ValueError("REF_SAMPLE_RATE was given without REF_AUDIO")
    return Voice(voice_id=check_name(voice_id, "VOICE_ID") if voice_id else "")


WITH_A_VOICE = (
    "INSTRUCTION cannot go with a voice (REF_AUDIO or VOICE_ID): FireRedTTS3-Instruct's cloning takes no "
    "instruction. Drop INSTRUCTION to clone the voice, drop the voice to design one from the instruction, or "
    f"send TASK {CLONE} for Instruct cloning of the voice"
)


@dataclass(frozen=True)
class SpeechRequest:
    """One ``tts`` request, checked (:func:`parse_request`): the orchestrator runs it as it is."""

    utterance: Utterance
    voice: Voice  # all empty: a silent prompt


def parse_request(inputs: TTSInputs, served=None) -> SpeechRequest:
    """Check one ``tts`` request -> what to say and in which voice; ValueError naming the input at fault. The
    parameters' JSON first, then the Instruct rules, then ``served.check`` (a :class:`ServedModels`, if given),
    then the inputs' own checks. The edits speak no text (their REF_AUDIO is the recording)."""
    given = parameter_dict(inputs.parameters)  # (JSON text: parsed here, once)
    given.pop(PACE, None)  # a paced request's token (serving.flow.pacing) is no speech parameter
    task, instruction = instruct_request(inputs)
    seed = inputs.seed
    if task:  # the Instruct task's defaults where the client gave none (TASK_DEFAULTS)
        given.setdefault("cfg", TASK_DEFAULTS[task].cfg)
        seed = TASK_DEFAULTS[task].seed if seed is None else seed
    if served is not None:
        served.check(task)
    text = "" if task in EDITS else check_text(inputs.text)
    language = check_language(inputs.language)
    voice = check_voice(inputs.ref_audio, inputs.ref_sample_rate, inputs.ref_text, inputs.voice_id)
    if task in EDITS and voice.ref_audio.size > MAX_EDIT_SECONDS * voice.ref_sample_rate:  # (an edit has REF_AUDIO)
        raise ValueError(f"REF_AUDIO is {voice.ref_audio.size / voice.ref_sample_rate:.1f} s long; TASK {task} "
                         f"edits at most {MAX_EDIT_SECONDS:g} s")  # fmt: skip
    values = parse_parameters(given, TTS_PARAMETERS)
    params, schedule = generation_params(check_seed(seed), values)
    utterance = Utterance(text, language, params, schedule, values["split_tokens"], values["normalize"],
                          values["speed"], task, instruction, values["read_ahead"])  # fmt: skip
    return SpeechRequest(utterance, voice)


def instruct_request(inputs: TTSInputs) -> tuple[str, str]:
    """How TASK, INSTRUCTION, TEXT and the voice of one ``tts`` request combine -> (the Instruct task, its
    instruction stripped: "" for CLONE) as :class:`~engine.orchestrator.Utterance` carries them, ("", "") for Base
    (``serving.contract.TASK_RULES``; ValueError naming the input at fault). An INSTRUCTION of spaces is given, and
    empty. The voice's own checks are :func:`parse_request`'s."""
    task = SPEAK if inputs.task is None or inputs.task == "" else inputs.task
    if task not in TASKS:
        raise ValueError(f"TASK must be one of {', '.join(TASKS)}, got {shown(task)}")
    instruction, text, ref_text = inputs.instruction, inputs.text, inputs.ref_text
    given = instruction is not None and instruction != ""
    has_voice = inputs.ref_audio is not None or bool(inputs.voice_id)
    if task in EDITS:
        if inputs.voice_id:
            raise ValueError(f"TASK {task} edits a recording sent as REF_AUDIO; VOICE_ID is not one")
        if inputs.ref_audio is None:
            raise ValueError(f"TASK {task} needs REF_AUDIO (with REF_SAMPLE_RATE): the recording to edit")
        if text is not None and text != "":
            raise ValueError(f"TASK {task} takes no TEXT: INSTRUCTION says what to change")
        if ref_text:
            raise ValueError(f"TASK {task} takes no REF_TEXT: the model transcribes the recording itself")
        if not given:
            raise ValueError(f"TASK {task} needs INSTRUCTION: what to change in the recording")
        return task, instructions.task_instruction(task, instruction, "INSTRUCTION")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"TEXT must be a non-empty string (TASK {task} speaks it)")
    if task == CLONE:
        if given:
            raise ValueError(f"TASK {CLONE} takes no INSTRUCTION: FireRedTTS3-Instruct's cloning prompt is fixed "
                             f"(drop INSTRUCTION, or the voice and TASK to design a voice)")  # fmt: skip
        if not has_voice:
            raise ValueError(f"TASK {CLONE} needs a voice: REF_AUDIO (with REF_SAMPLE_RATE) or VOICE_ID")
        return CLONE, ""
    if task == SPEAK and not given:
        return "", ""
    if task == DESIGN and not given:
        raise ValueError(f"TASK {DESIGN} needs INSTRUCTION, the voice description")
    if has_voice:
        raise ValueError(WITH_A_VOICE if task == SPEAK else f"TASK {DESIGN} takes no voice (REF_AUDIO or VOICE_ID): "
                         "it designs one from INSTRUCTION")  # fmt: skip
    if ref_text:
        raise ValueError("REF_TEXT was given for voice design, which takes no recording")
    return DESIGN, instructions.task_instruction(DESIGN, instruction, "INSTRUCTION")


MODELS = ("base", "instruct")  # the release's cores, in the checkpoint layout's order
MODEL_DIRS = {"base": "fireredtts3_base", "instruct": "fireredtts3_instruct"}
NAMES = {"base": "FireRedTTS3-Base", "instruct": "FireRedTTS3-Instruct"}


def parse_models(value: str) -> tuple[str, ...]:
    """``--models`` -> the cores, in MODELS order (ValueError for a name that is not one; () for empty)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in MODELS]
    if unknown:
        raise ValueError(f"models: unknown {', '.join(unknown)}; choose base, instruct or base,instruct")
    return tuple(m for m in MODELS if m in names)


@dataclass(frozen=True)
class ServedModels:
    """Which of the release's two models this server runs (``--models``): the generator loads exactly these,
    and tts refuses a request for another at once, naming it and how to start a server that has it."""

    models: tuple[str, ...]

    @classmethod
    def of(cls, checkpoint: str | Path, option: str) -> ServedModels:
        """``--models``, or when empty the cores the checkpoint folder holds."""
        folder = tuple(m for m in MODELS if (Path(checkpoint) / MODEL_DIRS[m] / "config.json").is_file())
        return cls(parse_models(option) or folder)

    def check(self, task: str) -> None:
        """ValueError when a request of Instruct ``task`` ("": Base) needs a model this server does not run."""
        need = "instruct" if task else "base"
        if need in self.models:
            return
        what = f"TASK {task}" if task else "this request (TASK speak, no INSTRUCTION)"
        raise ValueError(f"{what} needs {NAMES[need]}, which this server does not run (it runs "
                         f"{', '.join(NAMES[m] for m in self.models)}); start it with --models base,instruct on a "
                         f"checkpoint that has {MODEL_DIRS[need]}/")  # fmt: skip
