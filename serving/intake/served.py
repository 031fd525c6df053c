"""Which of the release's two models a server runs (``--models``), as tts checks it before any work.

``models`` is the launcher's option: "base", "instruct" or "base,instruct"; empty = the cores the checkpoint
folder holds. The generator loads exactly these (so a stream for another one fails there too); tts refuses
such a request at once, naming the model and how to start a server that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    models: tuple[str, ...]

    @classmethod
    def of(cls, checkpoint: str | Path, option: str) -> ServedModels:
        """``--models``, or when empty the cores the checkpoint folder holds."""
        folder = tuple(m for m in MODELS if (Path(checkpoint) / MODEL_DIRS[m] / "config.json").is_file())
        return cls(parse_models(option) or folder)

    def check(self, instruct) -> None:
        """ValueError when the request (its ``serving.intake.requests.InstructRequest``, None for Base) needs a model
        this server does not run."""
        need = "base" if instruct is None else "instruct"
        if need in self.models:
            return
        what = "this request (TASK speak, no INSTRUCTION)" if instruct is None else f"TASK {instruct.task}"
        raise ValueError(f"{what} needs {NAMES[need]}, which this server does not run (it runs "
                         f"{', '.join(NAMES[m] for m in self.models)}); start it with --models base,instruct on a "
                         f"checkpoint that has {MODEL_DIRS[need]}/")  # fmt: skip
