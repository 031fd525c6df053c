"""Unit tests for engine.text: prompt format, special tokens, tiny tokenizer."""

import json
from pathlib import Path

import pytest

from engine.text import (
    DIALECTS,
    LANGUAGES,
    SPECIAL_TOKENS,
    TextTokenizer,
    format_prompt,
    language_tag,
    write_tiny_tokenizer,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_dir)


def test_special_token_table() -> None:
    assert len(LANGUAGES) == 24 and LANGUAGES[:3] == ("Chinese", "English", "Cantonese")
    assert LANGUAGES[-1] == "Hindi"
    assert len(DIALECTS) == 21 and DIALECTS[0] == "ZH_Anhui" and DIALECTS[-1] == "ZH_Yunnan"
    assert len(SPECIAL_TOKENS) == len(set(SPECIAL_TOKENS)) == 15 + 192 + 24 + 21 + 3
    assert SPECIAL_TOKENS[0] == "<|sosp|>" and SPECIAL_TOKENS[14] == "<|UNDERSTANDING|>"
    assert SPECIAL_TOKENS[15] == "<|placeholder_001|>" and SPECIAL_TOKENS[206] == "<|placeholder_192|>"
    assert SPECIAL_TOKENS[207] == "<|Chinese|>" and SPECIAL_TOKENS[231] == "<|ZH_Anhui|>"
    assert SPECIAL_TOKENS[-3:] == ("<|edit|>", "<|frame_patch|>", "<|end_edit|>")


def test_format_prompt() -> None:
    assert format_prompt("Hello.") == "<|English|><|sot|>Hello.<|eot|>"
    assert format_prompt("世界", "Chinese", "你好，") == "<|Chinese|><|sot|>你好，世界<|eot|>"
    assert format_prompt("x", "zh_sichuan") == "<|ZH_Sichuan|><|sot|>x<|eot|>"


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_format_prompt_rejects_empty_text(text: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        format_prompt(text)


def test_language_tag() -> None:
    assert language_tag("English") == "<|English|>"
    assert language_tag("cantonese") == "<|Cantonese|>"
    assert language_tag("ZH_Wu") == "<|ZH_Wu|>"
    with pytest.raises(ValueError) as err:
        language_tag("Klingon")
    assert "'Klingon'" in str(err.value) and "Hindi" in str(err.value)


def test_missing_tokenizer_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        TextTokenizer.from_dir(missing)


def test_special_tokens_encode_to_one_id(tok: TextTokenizer) -> None:
    ids = {tok.encode(t)[0] for t in SPECIAL_TOKENS if len(tok.encode(t)) == 1}
    assert len(ids) == len(SPECIAL_TOKENS)
    assert all(tok.encode(t) == [tok.token_id(t)] for t in SPECIAL_TOKENS)


def test_encode_prompt_positions(tok: TextTokenizer) -> None:
    ids = tok.encode_prompt("你好，world!", "Chinese", "The prompt. ")
    assert ids[0] == tok.token_id("<|Chinese|>")
    assert ids[1] == tok.token_id("<|sot|>")
    assert ids[-1] == tok.token_id("<|eot|>")
    assert tok.decode(ids[2:-1]) == "The prompt. 你好，world!"
    special = {tok.token_id(t) for t in SPECIAL_TOKENS}
    assert not special & set(ids[2:-1])


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    n1 = write_tiny_tokenizer(tmp_path / "a")
    n2 = write_tiny_tokenizer(tmp_path / "b")
    assert n1 == n2 == 151_924  # the real vocabulary's size with FireRed's tokens
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tiny_tokenizer_files(tiny_dir: Path, tok: TextTokenizer) -> None:
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    vocab = json.loads((tiny_dir / "vocab.json").read_text())
    merges = (tiny_dir / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and len(vocab) >= 256 + len(merges) - 1
    assert tok.vocab_size == 151_924
    learned = [i for i in vocab.values() if i < 151_643]
    assert max(learned) < 1024 and len(learned) >= 256 + len(merges) - 1


def test_tiny_tokenizer_has_the_real_added_token_ids(tok: TextTokenizer) -> None:
    # written from Qwen3's tokenizer_config.json and the order of FireRed's load_text_tokenizer
    real = {
        "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_pad|>": 151654,
        "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "<|file_sep|>": 151664,
        "<think>": 151667, "</think>": 151668, "<|sosp|>": 151669, "<|eosp|>": 151670, "<|sot|>": 151676,
        "<|eot|>": 151677, "<|placeholder_001|>": 151684, "<|placeholder_192|>": 151875,
        "<|Chinese|>": 151876, "<|Hindi|>": 151899, "<|ZH_Anhui|>": 151900, "<|ZH_Yunnan|>": 151920,
        "<|edit|>": 151921, "<|end_edit|>": 151923,
    }  # fmt: skip
    assert {t: tok.token_id(t) for t in real} == real
    # the think block of Qwen3's chat format is not split
    assert tok.encode("<think>\n\n</think>") == [151667, *tok.encode("\n\n"), 151668]


@pytest.mark.parametrize(
    "text",
    ["The quick brown fox jumps over the lazy dog.", "今天天气很好，我们去公园吧。", "Mixed 中文 text, 123!\n  end"],
)
def test_tiny_tokenizer_round_trip(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_missing_specials_get_sequential_ids(tmp_path: Path) -> None:
    # A vocabulary without gaps that has Qwen's 3 tokens and FireRed's first 8 (through <|sot|>) only.
    from tokenizers import AddedToken, Tokenizer, models

    vocab = {"h": 0, "i": 1}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                                  ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *SPECIAL_TOKENS[:8])])  # fmt: skip
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    base = len(vocab) + 3

    tok = TextTokenizer.from_dir(tmp_path)
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(base, base + len(SPECIAL_TOKENS)))
    assert tok.token_id("<|sot|>") == base + 7
    assert tok.vocab_size == base + len(SPECIAL_TOKENS)
    assert tok.encode_prompt("hi", "Hindi") == [tok.token_id("<|Hindi|>"), base + 7, 0, 1, base + 8]
