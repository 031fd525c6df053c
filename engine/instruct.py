"""FireRedTTS3-Instruct's four tasks as the engine runs them: their names, defaults and text phase.

- ``design``: a new voice from a description; the model first writes a voice plan (text), then speaks.
- ``clone``: Instruct's in-context cloning from a reference clip and its transcript (no text phase).
- ``semantic_edit``: a recording's words changed by an instruction; the model first writes the new
  transcript (greedy), then speaks it in the recording's voice.
- ``acoustic_edit``: a recording's speed, pitch or volume changed (fixed instruction templates).

Defaults are the reference's (``fireredtts3/llm/fireredtts3_instruct.py``). No torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.text_sampling import DESIGN_SAMPLING, EDIT_SAMPLING, TextSampling

# The longest recording an edit takes: its patches sit in the prompt (one position each) and the edited
# speech is about as long, so 30 s (188 patches) keeps both well inside the 400-patch length limit.
MAX_EDIT_SECONDS = 30.0


class Task(enum.Enum):
    DESIGN = "design"
    CLONE = "clone"
    SEMANTIC_EDIT = "semantic_edit"
    ACOUSTIC_EDIT = "acoustic_edit"

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


DEFAULTS: dict[Task, TaskDefaults] = {
    Task.DESIGN: TaskDefaults(2, 1.2, DESIGN_SAMPLING),
    Task.CLONE: TaskDefaults(1234, 2.0, None),
    Task.SEMANTIC_EDIT: TaskDefaults(1234, 1.2, EDIT_SAMPLING),
    Task.ACOUSTIC_EDIT: TaskDefaults(1234, 1.2, None),
}

EDITS = (Task.SEMANTIC_EDIT, Task.ACOUSTIC_EDIT)


def check_edit_length(samples: int, sample_rate: int, field: str = "recording") -> None:
    """ValueError naming ``field`` when a recording to edit is longer than MAX_EDIT_SECONDS."""
    seconds = samples / sample_rate
    if seconds > MAX_EDIT_SECONDS:
        raise ValueError(f"{field} is {seconds:.1f} s; an edit takes at most {MAX_EDIT_SECONDS:g} s")
