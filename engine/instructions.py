"""Checking what a client sends to FireRedTTS3-Instruct: instructions, and the texts of its tasks.

An instruction is a voice description ("a calm older man, slightly hoarse"), a semantic edit ("Replace
'cats' with 'dogs'.") or an acoustic edit from fixed templates ("adjust the speed to 0.5x"). Whatever is
accepted reaches the model as sent, stripped of outer whitespace and nothing else: the model was trained
on these strings, and a rewritten instruction would also make our output differ from the reference's.

The texts go into a ChatML chat (:mod:`engine.chatml`), so they must not carry its control tokens: a
``<|im_end|>`` would close the user turn and let the rest pose as the assistant, an ``<|image_pad|>``
would add an audio placeholder, an ``<|eot|>`` would end a plan. Any ``<|`` or ``|>`` is refused, which
also covers tokens split over two texts that are joined (a cloning prompt's transcript and the text), and
so are Qwen3's angle-bracket tokens (``<think>``, ``<tool_call>``, ...). No torch here.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, localcontext

# A description is a sentence or two: the release's example is 20 Chinese characters, its edit examples
# under 60. 500 characters is several times a long description and keeps the prompt short (the reference
# repeats the instruction in every segment of a long text, and the model never saw long instructions).
MAX_INSTRUCTION_CHARS = 500

# Qwen3's added tokens without pipes; the tokenizer turns them into single ids wherever they appear.
QWEN_TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_ALLOWED_CONTROLS = ("\n", "\t")
_PIPE_TOKEN = re.compile(r"<\|[^<>|\s]{1,40}\|>")  # how the tokenizer's pipe tokens are written, for messages


def control_token_error(text: str) -> str | None:
    """What is wrong with ``text`` as a part of a ChatML string, or None.

    Looks at the text as sent and in NFC (the tokenizer's normalization), for ``<|``, ``|>`` and
    :data:`QWEN_TAG_TOKENS`; the message names the whole token where there is one (``'<|eot|>'``).
    """
    for form in (text, unicodedata.normalize("NFC", text)):
        for marker in ("<|", "|>"):
            if marker in form:
                token = _PIPE_TOKEN.search(form)
                if token:
                    return f"must not contain {marker!r}: {token.group()!r} is a control token of the model's tokenizer"
                return f"must not contain {marker!r} (ChatML control tokens such as <|im_end|> are not text)"
        lowered = form.lower()
        for tag in QWEN_TAG_TOKENS:
            if tag in lowered:
                return f"must not contain {tag!r} (a control token of the model's tokenizer)"
    return None


def check_instruction(text: str, field: str = "instruction", limit: int = MAX_INSTRUCTION_CHARS) -> str:
    """A voice description or an edit instruction, stripped of outer whitespace.

    Raises:
        ValueError: Naming ``field``: not a string, empty or whitespace only, longer than ``limit``
            characters (after stripping), a control character other than newline and tab, or a ChatML
            control token.
    """
    return _check(text, field, limit)


def check_spoken_text(text: str, field: str = "text", limit: int | None = None) -> str:
    """The text an Instruct task speaks (or a cloning prompt's transcript): the checks of
    :func:`check_instruction`, without its length limit unless ``limit`` is given (long texts are split
    into segments by the front end; their limit is the request's)."""
    return _check(text, field, limit)


def _check(text: str, field: str, limit: int | None) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{field} is empty")
    if limit is not None and len(stripped) > limit:
        raise ValueError(f"{field} is {len(stripped)} characters; the limit is {limit}")
    for position, char in enumerate(stripped):
        if char not in _ALLOWED_CONTROLS and unicodedata.category(char) in ("Cc", "Cs"):
            raise ValueError(
                f"{field} has a control character U+{ord(char):04X} at position {position} "
                "(only newlines and tabs are allowed)"
            )
    problem = control_token_error(stripped)
    if problem:
        raise ValueError(f"{field} {problem}")
    return stripped


@dataclass(frozen=True)
class AcousticTemplate:
    """One of the acoustic-edit instructions the model was trained on, ``{words} {value}{suffix}``."""

    words: str  # the words before the value, e.g. "adjust the speed to"
    quantity: str  # what the value is, for messages: "speed"
    low: Decimal  # smallest value
    high: Decimal  # largest value
    step: Decimal  # the grid of values (from low)
    suffix: str  # regex after the value: an optional "x", or "step"/"steps"
    shown: str  # the template as the release's README writes it, with its ranges
    excluded: tuple[Decimal, ...] = ()  # values in range that are not allowed (a pitch shift of 0)
    whole: bool = False  # the value is written as a whole number (no decimal point)

    def values_text(self) -> str:
        if self.whole:  # the pitch: -6..-1 or 1..6
            return f"a whole number in {self.low}..-{self.step} or {self.step}..{self.high}"
        return f"{self.low}..{self.high} in steps of {self.step}"


_TEMPLATES = (
    AcousticTemplate(
        "adjust the speed to", "speed", Decimal("0.5"), Decimal("2.0"), Decimal("0.1"), r"x?",
        "adjust the speed to X  (X from 0.5 to 2.0 in steps of 0.1, optionally followed by x: 0.5x)",
    ),
    AcousticTemplate(
        "shift the pitch by", "pitch shift", Decimal(-6), Decimal(6), Decimal(1), r"\s+steps?",
        "shift the pitch by N step(s)  (N from -6 to -1 or 1 to 6)", (Decimal(0),), whole=True,
    ),
    AcousticTemplate(
        "adjust the volume to", "volume", Decimal("0.3"), Decimal("2.0"), Decimal("0.1"), r"x?",
        "adjust the volume to X  (X from 0.3 to 2.0 in steps of 0.1)",
    ),
)  # fmt: skip
ACOUSTIC_TEMPLATES: tuple[str, ...] = tuple(template.shown for template in _TEMPLATES)

# Tolerated: any letter case, runs of spaces between words, a "+" before the number, a final period.
# Nothing is rewritten: what matched is what the model reads.
_NUMBER = r"([+-]?\d+(?:\.\d+)?)"
_PATTERNS = tuple(
    re.compile(r"\s+".join(map(re.escape, t.words.split())) + r"\s+" + _NUMBER + t.suffix + r"\.?", re.IGNORECASE)
    for t in _TEMPLATES
)


def check_acoustic_edit(text: str, field: str = "instruction") -> str:
    """An acoustic-edit instruction in one of :data:`ACOUSTIC_TEMPLATES`, stripped of outer whitespace.

    Raises:
        ValueError: Naming ``field``: the checks of :func:`check_instruction`; no template matches (the
            message lists them); or the value is out of range or off its grid (the message gives both).
    """
    stripped = check_instruction(text, field)
    for template, pattern in zip(_TEMPLATES, _PATTERNS, strict=True):
        match = pattern.fullmatch(stripped)
        if match:
            _check_value(template, match.group(1), field)
            return stripped
    listed = "; ".join(f"'{shown}'" for shown in ACOUSTIC_TEMPLATES)
    raise ValueError(f"{field} {_shown(stripped)} is not an acoustic edit the model knows; use one of: {listed}")


def _check_value(template: AcousticTemplate, number: str, field: str) -> None:
    # The number is at most MAX_INSTRUCTION_CHARS digits: with this precision the grid test is exact.
    with localcontext(prec=2 * MAX_INSTRUCTION_CHARS):
        value = Decimal(number)  # the pattern lets only decimal numbers through
        off_grid = ((value - template.low) / template.step) % 1 != 0 or (template.whole and "." in number)
    if off_grid or not template.low <= value <= template.high or value in template.excluded:
        raise ValueError(
            f"{field}: the {template.quantity} must be {template.values_text()}, got {number} "
            f"(template: '{template.shown}')"
        )


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


# ---- the tasks of a tts request (its TASK input) and the release's defaults for them ----
SPEAK = "speak"  # Base clones the voice (or speaks without one); with an instruction and no voice: DESIGN
CLONE = "clone"  # Instruct cloning: a voice, no instruction
DESIGN = "design"  # Instruct voice design: an instruction and a text, no voice
SEMANTIC_EDIT = "semantic_edit"  # Instruct: change a recording's words (the model rewrites its transcript)
ACOUSTIC_EDIT = "acoustic_edit"  # Instruct: change a recording's speed, pitch or volume (the templates)
TASKS = (SPEAK, CLONE, DESIGN, SEMANTIC_EDIT, ACOUSTIC_EDIT)
EDITS = (SEMANTIC_EDIT, ACOUSTIC_EDIT)

# The longest recording an edit takes, in seconds. The edited audio is generated in one segment of at most
# max_patches (400 patches, 64 s), and the slowest acoustic edit (speed 0.5x) doubles the length: 30 s
# stays within it. The recording also sits in the prompt, one placeholder per patch (188 for 30 s).
MAX_EDIT_SECONDS = 30.0


@dataclass(frozen=True)
class TaskDefaults:
    """What an Instruct task uses when the request gives no SEED or no ``cfg`` (the release's
    ``FireRedTTS3Instruct`` defaults in ``core.py``)."""

    seed: int  # sampling seed
    cfg: float  # classifier-free guidance weight of the audio phase


TASK_DEFAULTS = {
    CLONE: TaskDefaults(1234, 2.0),
    DESIGN: TaskDefaults(2, 1.2),
    SEMANTIC_EDIT: TaskDefaults(1234, 1.2),
    ACOUSTIC_EDIT: TaskDefaults(1234, 1.2),
}


def task_instruction(task: str, instruction: str, field: str = "instruction") -> str:
    """The instruction an Instruct ``task`` gives the model, checked and stripped: an acoustic edit's from
    the templates (:func:`check_acoustic_edit`), a design's or a semantic edit's free text
    (:func:`check_instruction`); cloning takes none, so "" (what it was given is not read).

    Raises:
        ValueError: naming ``field`` (an unknown task: naming the task).
    """
    if task not in TASK_DEFAULTS:
        raise ValueError(f"unknown Instruct task {task!r}; choose from {list(TASK_DEFAULTS)}")
    if task == CLONE:
        return ""
    return (check_acoustic_edit if task == ACOUSTIC_EDIT else check_instruction)(instruction, field)
