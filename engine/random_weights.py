"""What this project's random-weight checkpoints are and produce, for whoever meets one (the launcher, the
web page): light, no torch (the gateway imports it)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.text import QWEN_FIRST_ID

TOKENIZER_DIR = "text_tokenizer"  # engine.checkpoint's (which imports torch); a test checks they agree


def has_random_weights(root: str | Path) -> bool:
    """Whether the checkpoint at ``root`` is one of this project's random-weight checkpoints: they carry the
    tiny tokenizer, whose learned vocabulary (below Qwen's added tokens) is a small fraction of Qwen's 151,643."""
    try:
        vocab = json.loads((Path(root) / TOKENIZER_DIR / "vocab.json").read_text(encoding="utf-8"))
        return max(i for i in vocab.values() if i < QWEN_FIRST_ID) + 1 < QWEN_FIRST_ID // 2
    except (OSError, ValueError):
        return False


# What random weights produce, said wherever a newcomer meets them (the launcher, the web page, the README).
RANDOM_WEIGHTS_NOTE = (
    "random weights: what you hear is noise-like audio of a fixed length (about 1 s, whatever the text), a "
    "designed voice's plan is garbled text (random tokens, shown as U+FFFD replacement characters) and a "
    "semantic edit's transcript is empty. That is this checkpoint, not a fault: docs/gpu.md serves the real "
    "weights."
)
