"""FireRedTTS3-Instruct's four tasks as the engine runs them: which writes text first, and how.

- ``design``: a new voice from a description; the model first writes a voice plan (text), then speaks.
- ``clone``: Instruct's in-context cloning from a reference clip and its transcript (no text phase).
- ``semantic_edit``: a recording's words changed by an instruction; the model first writes the new
  transcript (greedy), then speaks it in the recording's voice.
- ``acoustic_edit``: a recording's speed, pitch or volume changed (fixed instruction templates).

The task names, their seeds and cfg and the edits' length limit are :mod:`engine.instructions`' (the
serving contract reads them there, without torch); this module adds the text phase's sampling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine import instructions
from engine.config import PATCH_SAMPLES
from engine.protocol import SAMPLE_RATE
from engine.text_sampling import DESIGN_SAMPLING, EDIT_SAMPLING, TextSampling


class Task(enum.Enum):
    DESIGN = instructions.DESIGN
    CLONE = instructions.CLONE
    SEMANTIC_EDIT = instructions.SEMANTIC_EDIT
    ACOUSTIC_EDIT = instructions.ACOUSTIC_EDIT

    @classmethod
    def parse(cls, name: str) -> Task:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown Instruct task {name!r}; choose from {[t.value for t in cls]}") from None


@dataclass(frozen=True)
class TaskDefaults:
    seed: int  # the reference's default seed
    cfg: float  # the flow's guidance weight
    sampling: TextSampling | None  # the text phase's token choice; None: the task writes no text


_SAMPLING = {Task.DESIGN: DESIGN_SAMPLING, Task.SEMANTIC_EDIT: EDIT_SAMPLING}
DEFAULTS: dict[Task, TaskDefaults] = {
    t: TaskDefaults(instructions.TASK_DEFAULTS[t.value].seed, instructions.TASK_DEFAULTS[t.value].cfg, _SAMPLING.get(t))
    for t in Task
}
EDITS = tuple(Task(t) for t in instructions.EDITS)


def check_edit_patches(patches: int) -> None:
    """ValueError when latents of a recording to edit are more patches than the longest recording fills once
    left-padded to whole patches (30 s: 187.5 patches, padded to 188). The recording's own limit is measured
    on the user's file, in samples at its rate (:func:`check_edit_length`): padding is ours, never the user's."""
    most = -(-int(instructions.MAX_EDIT_SECONDS * SAMPLE_RATE) // PATCH_SAMPLES)
    if patches > most:
        padded = patches * PATCH_SAMPLES / SAMPLE_RATE
        raise ValueError(f"the recording is {patches} patches ({padded:.2f} s padded); an edit takes at most "
                         f"{instructions.MAX_EDIT_SECONDS:g} s ({most} patches)")  # fmt: skip


def check_edit_length(samples: int, sample_rate: int, field: str = "recording") -> None:
    """ValueError naming ``field`` when a recording to edit is longer than MAX_EDIT_SECONDS."""
    seconds = samples / sample_rate
    if seconds > instructions.MAX_EDIT_SECONDS:
        raise ValueError(f"{field} is {seconds:.1f} s; an edit takes at most {instructions.MAX_EDIT_SECONDS:g} s")
