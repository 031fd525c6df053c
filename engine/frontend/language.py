"""Front end step 2: the language of a text, when none is given (or ``auto``).

By script, as the reference does without a language-id model (:func:`detect_by_script`), or with a
fastText model when one is configured (:func:`use_lid_model`, or ``FIREREDTTS3_LID_MODEL``).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import regex

LID_MODEL_ENV = "FIREREDTTS3_LID_MODEL"  # optional fastText language-id model (lid.176.bin / .ftz)

HAN = re.compile(r"[\u4e00-\u9fff]")  # a Han character: Chinese here, and Chinese grammar for wetext
_KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff]")
# fastText's ISO 639-1 labels for the languages the model has a tag for.
_ISO_TO_LANGUAGE = {
    "zh": "Chinese", "en": "English", "ja": "Japanese", "ko": "Korean", "es": "Spanish",
    "fr": "French", "ru": "Russian", "ar": "Arabic", "tr": "Turkish", "id": "Indonesian",
    "pt": "Portuguese", "it": "Italian", "nl": "Dutch", "vi": "Vietnamese", "de": "German",
    "uk": "Ukrainian", "th": "Thai", "pl": "Polish", "ro": "Romanian", "el": "Greek",
    "cs": "Czech", "fi": "Finnish", "hi": "Hindi",
}  # fmt: skip
# Scripts the fastText model is asked about (Latin needs a word of 3+ letters to be worth asking).
_OTHER_SCRIPTS = re.compile(
    r"[\uac00-\ud7af\u0400-\u052f\u0600-\u06ff\u0750-\u077f\u0900-\u097f\u0e00-\u0e7f\u0370-\u03ff]"
)
_CJK_PUNCTUATION = re.compile(r"[\u3000-\u303f\uff01-\uff0f\uff1a-\uff20]")


def detect_by_script(text: str) -> str:
    """The reference's rule when it has no language-id model: any Han character means Chinese, else
    any kana means Japanese, else English (so Korean or Russian text without a language is English)."""
    if HAN.search(text):
        return "Chinese"
    if _KANA.search(text):
        return "Japanese"
    return "English"


class FastTextLid:
    """A fastText language-id model (Meta's ``lid.176``), used as the reference uses it when present:
    kana, Han and CJK punctuation decide on their own; other text is asked to the model, and a
    label without a FireRedTTS3 language falls back to :func:`detect_by_script`.

    The model file is never downloaded: pass its path (or set ``FIREREDTTS3_LID_MODEL``).

    Raises:
        RuntimeError: the ``fasttext`` package is not installed.
        FileNotFoundError: no file at ``path``.
    """

    def __init__(self, path: str | Path):
        try:
            import fasttext  # optional dependency
        except ImportError:
            raise RuntimeError(
                f"language-id model {path} given, but the fasttext package is not installed "
                "(pip install fasttext-wheel), or unset it to detect by script"
            ) from None
        if not Path(path).is_file():
            raise FileNotFoundError(f"language-id model not found: {path}")
        self._model = fasttext.load_model(str(path))
        self._lock = threading.Lock()

    def guess(self, text: str) -> str | None:
        """The model's top language, if FireRedTTS3 has a tag for it."""
        snippet = text.replace("\n", " ").strip()
        if not snippet:
            return None
        with self._lock:
            preds = self._model.f.predict(snippet, 1, 0.0, "strict")  # numpy-2-safe low-level call
        if not preds:
            return None
        return _ISO_TO_LANGUAGE.get(preds[0][1].removeprefix("__label__"))

    def __call__(self, text: str) -> str:
        if _KANA.search(text):
            return "Japanese"
        if HAN.search(text) or _CJK_PUNCTUATION.search(text):
            return "Chinese"
        worth_asking = _OTHER_SCRIPTS.search(text) or regex.search(r"[A-Za-zÀ-ÿ]{3,}", text)
        return (worth_asking and self.guess(text)) or detect_by_script(text)


_lid: Callable[[str], str] | None = None
_lid_loaded = False


def use_lid_model(path: str | Path | None) -> None:
    """Detect languages with the fastText model at ``path`` from now on (None: by script)."""
    global _lid, _lid_loaded
    _lid, _lid_loaded = (FastTextLid(path) if path else None), True


def detect_language(text: str) -> str:
    """The language of ``text``: by the fastText model if one is configured (:func:`use_lid_model`,
    or ``FIREREDTTS3_LID_MODEL`` read on first use), else by :func:`detect_by_script`."""
    if not _lid_loaded:
        use_lid_model(os.environ.get(LID_MODEL_ENV) or None)
    return (_lid or detect_by_script)(text)
