"""Property tests of request parsing: whatever a client sends, parsing gives values within the declared
ranges or a ValueError naming the offending input or parameter as the client spelled it, never another
exception."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.audio import MAX_REFERENCE_PEAK, MAX_REFERENCE_SECONDS, REFERENCE_RATES
from engine.params import parse_parameters
from engine.text import DIALECTS, LANGUAGES
from serving.contract import TTS_PARAMETERS
from serving.intake.requests import (
    TTSInputs,
    check_language,
    check_ref_audio,
    check_text,
    parse_request,
)
from serving.security.auth import parameter_dict
from serving.stub.triton_io import string

SPECS = {p.name: p for p in TTS_PARAMETERS}
INPUTS = ("TEXT", "LANGUAGE", "REF_AUDIO", "REF_SAMPLE_RATE", "REF_TEXT", "VOICE_ID", "SEED")
FAST = settings(deadline=None, max_examples=300)

scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats() | st.text(max_size=12) | st.sampled_from(["3", "2.5", " 7 ", "1e400", "nan", "-inf", "0x10", "１２"])
)  # fmt: skip
json_values = st.recursive(scalars, lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=4), v, max_size=3),
                           max_leaves=6)  # fmt: skip
keys = st.sampled_from(sorted(SPECS)) | st.text(max_size=10)


def request_parameters(raw) -> dict:
    """A tts request's parameters as parse_request reads them (JSON text or a dict)."""
    return parse_parameters(parameter_dict(raw), TTS_PARAMETERS)


def build_request(*inputs):
    """A ``tts`` request's (utterance, voice) from its inputs in :class:`TTSInputs`' order, as tts parses it."""
    speech = parse_request(TTSInputs(*inputs))
    return speech.utterance, speech.voice


def names(key: str, message: str) -> bool:
    return key in message or repr(key) in message


def valid(key: str, value) -> bool:
    """An oracle written apart from engine.params: is this a value the parameter accepts?"""
    p = SPECS.get(key)
    if p is None:
        return False
    if p.type is bool:
        return value is True or value is False
    if isinstance(value, bool):
        return False
    if p.type is int:
        return isinstance(value, int) and p.low <= value <= p.high
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(number) and p.low <= number <= p.high


@FAST
@given(st.dictionaries(keys, json_values, max_size=5), st.booleans())
def test_parameters_parse_within_range_or_name_the_key(given_params, as_json):
    raw = json.dumps(given_params) if as_json else given_params
    bad = [k for k, v in given_params.items() if not valid(k, v)]
    try:
        out = request_parameters(raw)
    except ValueError as e:
        assert bad, f"refused valid parameters {given_params!r}: {e}"
        assert any(names(k, str(e)) for k in bad), f"{e} names none of {bad}"
        return
    assert not bad, f"accepted {bad} of {given_params!r}"
    for name, p in SPECS.items():
        value = out[name]
        assert type(value) is p.type and p.low <= value <= p.high
        if name in given_params:
            assert value == (float(given_params[name]) if p.type is float else given_params[name])


@given(st.text(max_size=20) | st.sampled_from(["[1, 2]", "5", "null", '"x"', "true", "[" * 100_000, "{" * 3]))
def test_parameters_that_are_not_a_json_object_are_refused(raw):
    try:
        request_parameters(raw)
    except ValueError as e:
        assert "request parameters" in str(e) or str(e).startswith("parameter "), e


@FAST
@given(st.none() | st.text(max_size=50), st.none() | st.text(max_size=20) | st.sampled_from(LANGUAGES + DIALECTS))
def test_text_and_language(text, language):
    try:
        assert check_text(text) == text and text.strip()
    except ValueError as e:
        assert str(e).startswith("TEXT ")
    try:
        got = check_language(language)
    except ValueError as e:
        assert str(e).startswith("LANGUAGE")
    else:  # absent or auto: detected later; otherwise the canonical spelling of a known name
        assert (
            got is None
            if not (language or "").strip() or language.strip().lower() == "auto"
            else got in LANGUAGES + DIALECTS
        )
        assert got is None or got.lower() == language.strip().lower()
    try:
        assert check_text(text or "", "REF_TEXT", required=False) == (text or "")
    except ValueError as e:  # only for a control token, which an oracle apart from it finds
        assert str(e).startswith("REF_TEXT ") and ("<|" in text or "|>" in text or "<" in text), e


class FakeTensor:
    def __init__(self, arr):
        self.arr = arr

    def as_numpy(self):
        return self.arr


class FakePB:
    """Just enough of triton_python_backend_utils for serving.stub.triton_io.string."""

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return FakeTensor(request[name]) if name in request else None


@given(st.binary(max_size=30), st.sampled_from(["TEXT", "LANGUAGE", "REF_TEXT", "VOICE_ID"]))
def test_any_bytes_decode_or_name_the_input(raw, name):
    try:
        assert string(FakePB, {name: np.array([raw], np.object_)}, name).encode("utf-8") == raw
    except ValueError as e:
        assert str(e) == f"{name} is not valid UTF-8"


edges = [np.nan, np.inf, -np.inf, 1e30, -1e30, 4.0, 4.0001, 32767.0]
audio_arrays = (
    hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(-1, 1, width=32))
    | hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(width=32) | st.sampled_from(edges).map(np.float32))
    | hnp.arrays(np.float64, st.integers(0, 64), elements=st.floats() | st.sampled_from(edges))
)
rates = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.sampled_from([8000, 16000, 192000, 192001])


@FAST
@given(audio_arrays, rates)
def test_ref_audio_is_valid_or_names_the_input(audio, rate):
    try:
        out, sr = check_ref_audio(audio, rate)
    except ValueError as e:
        assert str(e).startswith(("REF_AUDIO ", "REF_SAMPLE_RATE ")), e
        return
    assert out.dtype == np.float32 and out.ndim == 1 and 0 < out.size <= MAX_REFERENCE_SECONDS * sr
    assert np.isfinite(out).all() and np.abs(out).max() <= MAX_REFERENCE_PEAK
    assert type(sr) is int and REFERENCE_RATES[0] <= sr <= REFERENCE_RATES[1]


def test_long_reference_names_the_input():
    try:
        check_ref_audio(np.zeros(60 * 8000 + 1, np.float32), 8000)
    except ValueError as e:
        assert str(e).startswith("REF_AUDIO is 60.0 s")
    else:
        raise AssertionError("a reference over 60 s was accepted")


@FAST
@given(
    text=st.none() | st.text(max_size=10),
    language=st.none() | st.sampled_from(["", "English", "klingon", "zh_sichuan"]),
    audio=st.none() | audio_arrays,
    rate=rates,
    ref_text=st.none() | st.text(max_size=5),
    voice_id=st.none() | st.sampled_from(["", "narrator", "../x", "a" * 65]),
    seed=st.none() | st.integers(-(2**70), 2**70),
    params=st.none() | st.dictionaries(keys, json_values, max_size=3),
)
def test_build_request_accepts_or_names_a_field(text, language, audio, rate, ref_text, voice_id, seed, params):
    try:
        utterance, voice = build_request(text, language, audio, rate, ref_text, voice_id, seed, params)
    except ValueError as e:
        assert any(n in str(e) for n in INPUTS) or any(names(k, str(e)) for k in params or {}), e
        return
    assert utterance.text == text and (voice.ref_audio is None or voice.ref_audio.dtype == np.float32)
    assert -(2**63) <= utterance.params.seed < 2**63


def test_every_max_patches_in_range_is_usable():
    """The stop head's minimum (6 patches) yields to a shorter max_patches instead of refusing it."""
    for n in (1, 5, 6, 4000):
        utterance, _ = build_request("Hi", None, None, None, None, None, None, {"max_patches": n})
        assert utterance.params.max_patches == n and utterance.params.min_patches == min(6, n)


def test_speed_reaches_the_utterance():
    assert build_request("Hi", None, None, None, None, None, None, None)[0].speed == 1.0
    for sent, speed in ((2, 2.0), ("0.25", 0.25), (4.0, 4.0)):  # text too: BLS requests carry no floats
        assert build_request("Hi", None, None, None, None, None, None, {"speed": sent})[0].speed == speed
    for bad in (0.2, 4.01, "fast", True):
        try:
            build_request("Hi", None, None, None, None, None, None, {"speed": bad})
        except ValueError as e:
            assert str(e).startswith("parameter speed "), e
        else:
            raise AssertionError(f"speed {bad!r} was accepted")


CONTROL_TOKENS = ["<|eot|>", "<|im_start|>", "<|sosp|>", "<|image_pad|>", "<think>"]


@given(st.sampled_from(CONTROL_TOKENS), st.text(max_size=20), st.text(max_size=20), st.integers(0, 12))
@FAST
def test_text_fields_never_carry_a_control_token(token, before, after, cut):
    """As sent, or hidden by a zero-width space that cleaning strips (the token re-forms): refused, naming
    the field (Base TEXT and REF_TEXT, tts_ensemble's TEXT and PROMPT_TEXT all pass check_text)."""
    cut = min(cut, len(token) - 1)
    for text in (before + token + after, before + token[:cut] + "\u200b" + token[cut:] + after):
        for field in ("TEXT", "REF_TEXT", "PROMPT_TEXT"):
            try:
                check_text(text, field, required=False)
            except ValueError as e:
                assert str(e).startswith(field) and ("control token" in str(e) or "characters" in str(e)), e
            else:
                raise AssertionError(f"accepted {text!r} as {field}")


def test_build_request_refuses_control_tokens_in_text_and_ref_text():
    clip = np.zeros(8000, np.float32)
    for text, ref_text, field in [("Say <|eot|>", "", "TEXT"), ("Hi.", "a <|sos\u200bp|> b", "REF_TEXT")]:
        try:
            build_request(text, None, clip, 8000, ref_text, None, None, {"normalize": False})
        except ValueError as e:
            assert str(e).startswith(field), e
        else:
            raise AssertionError(f"accepted {text!r} / {ref_text!r}")
    assert build_request("x < y | z", None, clip, 8000, "a|b", None, None, None)[0].text == "x < y | z"
