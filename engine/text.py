"""Text side of FireRedTTS3: special tokens, prompt formatting and the BPE tokenizer.

The checkpoint ships a Qwen2 byte-level BPE tokenizer; FireRed adds its own special
tokens on load (language tags, ``<|sot|>``/``<|eot|>``, placeholders). This module
reproduces that with the ``tokenizers`` library alone, so ids match
``transformers.AutoTokenizer`` without importing it (or torch).
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

LANGUAGES: tuple[str, ...] = (
    "Chinese", "English", "Cantonese", "Japanese", "Korean", "Spanish",
    "French", "Russian", "Arabic", "Turkish", "Indonesian", "Portuguese",
    "Italian", "Dutch", "Vietnamese", "German", "Ukrainian", "Thai",
    "Polish", "Romanian", "Greek", "Czech", "Finnish", "Hindi",
)  # fmt: skip

DIALECTS: tuple[str, ...] = tuple(
    f"ZH_{name}"
    for name in (
        "Anhui", "Fujian", "Gansu", "Guizhou", "Hebei", "Henan", "Hubei",
        "Hunan", "Jiangxi", "Liaoning", "Minnan", "Ningxia", "Shaanxi",
        "Shandong", "Shanghai", "Shanxi", "Sichuan", "Tianjin", "Wenzhou",
        "Wu", "Yunnan",
    )
)  # fmt: skip

# Order matters: tokens missing from a vocab get the next free id in this order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|sosp|>", "<|eosp|>", "<|empty|>", "<|Human|>", "<|SpeechLM|>",
    "<|sostm|>", "<|eostm|>", "<|sot|>", "<|eot|>", "<|TEXT_ONLY|>",
    "<|AUDIO_ONLY|>", "<|ASR|>", "<|TTS|>", "<|INTERLEAVE|>", "<|UNDERSTANDING|>",
    *(f"<|placeholder_{i:03d}|>" for i in range(1, 193)),
    *(f"<|{name}|>" for name in LANGUAGES),
    *(f"<|{name}|>" for name in DIALECTS),
    "<|edit|>", "<|frame_patch|>", "<|end_edit|>",
)  # fmt: skip

SOT = "<|sot|>"
EOT = "<|eot|>"

# The added tokens of Qwen3's tokenizer, at their ids from QWEN_FIRST_ID on, and whether each is special
# (the tool and think markers are not). The Instruct model's code compares literal ids of this table
# (151655 <|image_pad|>, 151656 <|video_pad|>) and of FireRed's tokens after it (151669 <|sosp|>, 151677
# <|eot|>), so the tiny tokenizer carries every one of them at exactly these ids.
QWEN_FIRST_ID = 151_643
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)  # fmt: skip
QWEN_SPECIAL_TOKENS: tuple[str, ...] = tuple(t for t, special in QWEN_ADDED_TOKENS if special)
FIRERED_FIRST_ID = QWEN_FIRST_ID + len(QWEN_ADDED_TOKENS)  # 151669 <|sosp|>: SPECIAL_TOKENS follow in order

# Qwen2's pre-tokenization regex (contractions, letters, single digits, punctuation, spaces).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TAG_NAMES: tuple[str, ...] = LANGUAGES + DIALECTS
_TAG_BY_LOWER: dict[str, str] = {name.lower(): name for name in _TAG_NAMES}


def canonical_language(language: str) -> str:
    """The name as ``LANGUAGES`` or ``DIALECTS`` spells it (``"chinese"`` -> ``"Chinese"``).

    The front end's rules compare names exactly (Chinese is split by characters, only some
    languages are normalized), so every name is put in this form first.

    Raises:
        ValueError: The language is unknown; the message lists the valid names.
    """
    name = language if language in _TAG_NAMES else _TAG_BY_LOWER.get(str(language).strip().lower())
    if name is None:
        raise ValueError(
            f"unknown language {language!r}; valid languages: {', '.join(LANGUAGES)}; "
            f"valid dialects: {', '.join(DIALECTS)}; or auto to detect it"
        )
    return name


def language_tag(language: str) -> str:
    """Return the tag ``<|Name|>`` for a language or Chinese dialect.

    Args:
        language: A name from ``LANGUAGES`` or ``DIALECTS``, matched case-insensitively.

    Raises:
        ValueError: The language is unknown; the message lists the valid names.
    """
    return f"<|{canonical_language(language)}|>"


def format_prompt(text: str, language: str = "English", prompt_text: str = "") -> str:
    """Build the LLM text prompt ``<|Language|><|sot|>{prompt_text}{text}<|eot|>``.

    ``prompt_text`` is the transcript of the reference audio; it precedes the text to
    speak with no separator, as in the reference implementation.

    Raises:
        ValueError: ``text`` is empty or whitespace, or the language is unknown.
    """
    if not text or not text.strip():
        raise ValueError("text to synthesize is empty")
    return f"{language_tag(language)}{SOT}{prompt_text}{text}{EOT}"


class TextTokenizer:
    """Qwen2 BPE tokenizer with FireRed's special tokens added.

    Args:
        tokenizer: A loaded ``tokenizers.Tokenizer``. Any entry of ``SPECIAL_TOKENS``
            missing from its vocabulary is added as a special token, in order, taking
            the next free id (what ``add_tokens(..., special_tokens=True)`` does in HF).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        for token in SPECIAL_TOKENS:
            if token not in vocab:
                tokenizer.add_special_tokens([_special(token)])
        self._text_only = _without_added_tokens(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load ``<path>/tokenizer.json``.

        Raises:
            FileNotFoundError: The folder or its ``tokenizer.json`` does not exist.
        """
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"text tokenizer not found: {file} does not exist")
        return cls(Tokenizer.from_file(str(file)))

    @property
    def vocab_size(self) -> int:
        """One past the largest id, added tokens included (HF's ``len(tokenizer)`` for a vocabulary
        without gaps; the tiny one has a gap below Qwen's added tokens)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it map to their single id."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as text only: a control token written in it (``<|eot|>``, ``<think>``)
        is spelled out in ordinary tokens, never its id. Text without one gets :meth:`encode`'s ids."""
        return self._text_only.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str, language: str = "English", prompt_text: str = "") -> list[int]:
        """Token ids of ``format_prompt(text, language, prompt_text)``, the client's part (``prompt_text`` and
        ``text``) by :meth:`encode_text`: the front door refuses control tokens in it, and whatever got past
        would still not become one. The same ids as encoding the whole string for every other text (the
        tokenizer encodes the text between two added tokens on its own)."""
        format_prompt(text, language, prompt_text)  # its checks
        return self.encode(language_tag(language) + SOT) + self.encode_text(prompt_text + text) + self.encode(EOT)

    def token_id(self, token: str) -> int:
        """Id of a single token, e.g. ``"<|eot|>"``.

        Raises:
            ValueError: ``token`` is not in the vocabulary.
        """
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the text vocabulary")
        return token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _without_added_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that knows no added tokens (special or not): its BPE alone."""
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


def _special(token: str) -> AddedToken:
    return AddedToken(token, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _byte_symbols() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes, in the order Qwen2's vocab lists them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


# Fixed corpus for the tiny tokenizer's merges; edit it and every tiny checkpoint changes.
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Hello, this is a streaming text to speech server. "
    "It speaks English, Chinese and many other languages with the voice of the prompt. "
    "Welcome to the test; the model reads the text and then it speaks the words aloud. "
    "There are three things: speech, text and the sound of the voice in the room. "
    "I think that this is the best one, and we will see it in the morning. "
    "你好，世界。今天天气很好，我们一起去公园散步吧。"
)


def _learn_merges(pre_tokenizer: pre_tokenizers.PreTokenizer, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on ``_TINY_CORPUS``; ties go to the smallest pair, so output is fixed."""
    words = Counter(tuple(w) for w, _ in pre_tokenizer.pre_tokenize_str(_TINY_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def write_tiny_tokenizer(path: str | Path, n_merges: int = 144, model_max_length: int = 32768) -> int:
    """Write a small Qwen2-style byte-level BPE tokenizer into folder ``path``.

    Writes ``tokenizer.json``, ``tokenizer_config.json``, ``vocab.json`` and
    ``merges.txt`` like the real checkpoint, byte-identical on every call. The vocab is
    the 256 byte symbols plus up to ``n_merges`` merges learned from a built-in corpus,
    then Qwen3's added tokens and all of FireRed's special tokens at their real ids
    (``QWEN_FIRST_ID`` on; the ids between are unused).

    Returns:
        One past the largest id: 151,924, as the real tokenizer with FireRed's tokens.
    """
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    merges = _learn_merges(pre, n_merges)
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    # Added tokens take the id of their entry in the model's vocabulary when it has one (``tokenizers``
    # ignores the ids written under ``added_tokens``): that is how they sit at the real ids here.
    fixed = [(t, QWEN_FIRST_ID + i) for i, (t, _) in enumerate(QWEN_ADDED_TOKENS)]
    fixed += [(t, FIRERED_FIRST_ID + i) for i, t in enumerate(SPECIAL_TOKENS)]
    vocab.update(fixed)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    flags = [*QWEN_ADDED_TOKENS, *((t, True) for t in SPECIAL_TOKENS)]
    for token, special in flags:
        if special:
            tok.add_special_tokens([_special(token)])
        else:
            tok.add_tokens([AddedToken(token, single_word=False, lstrip=False, rstrip=False, normalized=False)])
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": special,
        }
        for t, special in flags
    }  # fmt: skip
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    merges_txt = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (out / "merges.txt").write_text(merges_txt, encoding="utf-8")
    return max(vocab.values()) + 1
