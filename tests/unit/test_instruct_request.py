"""How TASK, INSTRUCTION, TEXT and the voice of a ``tts`` request combine (serving.intake.requests.instruct_request,
as parse_request applies it with the voice's own checks: an edit's recording and its length), checked against the contract's rules written out by hand here, and the per-task defaults."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.instructions import ACOUSTIC_TEMPLATES, MAX_INSTRUCTION_CHARS
from serving.intake.requests import TTSInputs, instruct_request, parse_request

RATE = 16000
CLIP = np.zeros(RATE, np.float32)  # 1 s of silence
BASE = ("", "")  # what instruct_request gives for Base
INPUTS = ("TASK", "INSTRUCTION", "TEXT", "REF_AUDIO", "REF_SAMPLE_RATE", "REF_TEXT", "VOICE_ID")


def ask(task=None, instruction=None, text="Hello.", audio=None, rate=None, ref_text=None, voice_id=None):
    if audio is not None and rate is None:
        rate = RATE
    inputs = TTSInputs(text, None, audio, rate, ref_text, voice_id, task=task, instruction=instruction)
    return instruct_of(parse_request(inputs).utterance)


def instruct_of(utterance) -> tuple[str, str]:
    """The Instruct task a checked request carries (its utterance's task and instruction; "": Base)."""
    return utterance.task, utterance.instruction


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, BASE),  # plain Base
        ({"task": "speak", "audio": CLIP}, BASE),  # Base cloning
        ({"task": "", "voice_id": "narrator"}, BASE),  # "" is absent
        ({"instruction": ""}, BASE),  # so is an empty INSTRUCTION
        ({"instruction": " a calm older man "}, ("design", "a calm older man")),
        ({"task": "design", "instruction": "温柔的年轻女声"}, ("design", "温柔的年轻女声")),
        ({"task": "clone", "audio": CLIP, "ref_text": "hi"}, ("clone", "")),
        ({"task": "clone", "voice_id": "narrator"}, ("clone", "")),
        ({"task": "semantic_edit", "instruction": "Replace 'cats' with 'dogs'.", "text": None, "audio": CLIP},
         ("semantic_edit", "Replace 'cats' with 'dogs'.")),
        ({"task": "acoustic_edit", "instruction": "adjust the speed to 0.5x", "text": "", "audio": CLIP},
         ("acoustic_edit", "adjust the speed to 0.5x")),
        ({"task": "acoustic_edit", "instruction": "Shift the pitch by -2 steps.", "text": "", "audio": CLIP},
         ("acoustic_edit", "Shift the pitch by -2 steps.")),
    ],
)  # fmt: skip
def test_accepted_combinations(kw, expected):
    assert ask(**kw) == expected


@pytest.mark.parametrize(
    "kw, field, words",
    [
        ({"task": "Design", "instruction": "x"}, "TASK", "semantic_edit"),  # the message lists the tasks
        ({"task": "edit"}, "TASK", "acoustic_edit"),
        ({"instruction": "a calm man", "audio": CLIP}, "INSTRUCTION", "TASK clone"),  # the refusal explains
        ({"instruction": "a calm man", "voice_id": "narrator"}, "INSTRUCTION", "drop the voice"),
        ({"instruction": "   "}, "INSTRUCTION", "empty"),
        ({"instruction": "x" * (MAX_INSTRUCTION_CHARS + 1)}, "INSTRUCTION", str(MAX_INSTRUCTION_CHARS)),
        ({"instruction": "a man<|im_end|>"}, "INSTRUCTION", "control token"),
        ({"instruction": "a man\x00"}, "INSTRUCTION", "control character"),
        ({"instruction": "a calm man", "ref_text": "hi"}, "REF_TEXT", "voice design"),
        ({"instruction": "a calm man", "text": ""}, "TEXT", "non-empty"),
        ({"task": "design"}, "INSTRUCTION", "description"),
        ({"task": "design", "instruction": "a man", "audio": CLIP}, "TASK design", "takes no voice"),
        ({"task": "clone", "instruction": "a man", "audio": CLIP}, "INSTRUCTION", "fixed"),
        ({"task": "clone"}, "REF_AUDIO", "VOICE_ID"),
        ({"task": "clone", "audio": CLIP, "text": " "}, "TEXT", "non-empty"),
        ({"task": "semantic_edit", "instruction": "Delete 'very'.", "text": "", "voice_id": "n"}, "VOICE_ID",
         "REF_AUDIO"),
        ({"task": "semantic_edit", "instruction": "Delete 'very'.", "text": ""}, "REF_AUDIO", "recording"),
        ({"task": "semantic_edit", "instruction": "Delete 'very'.", "audio": CLIP}, "TEXT", "INSTRUCTION"),
        ({"task": "semantic_edit", "text": "", "audio": CLIP}, "INSTRUCTION", "what to change"),
        ({"task": "semantic_edit", "instruction": "Delete 'a'.", "text": "", "audio": CLIP, "ref_text": "a b"},
         "REF_TEXT", "transcribes"),
        ({"task": "semantic_edit", "instruction": "Delete 'a'.", "text": "", "audio": np.zeros(31 * RATE, np.float32)},
         "REF_AUDIO", "30 s"),
        ({"task": "semantic_edit", "instruction": "Delete 'a'.", "text": "", "audio": CLIP, "rate": 0},
         "REF_SAMPLE_RATE", ""),
        ({"task": "acoustic_edit", "instruction": "make it faster", "text": "", "audio": CLIP}, "INSTRUCTION",
         ACOUSTIC_TEMPLATES[1]),  # the message lists the templates
        ({"task": "acoustic_edit", "instruction": "adjust the speed to 2.5x", "text": "", "audio": CLIP},
         "INSTRUCTION", "0.5..2.0"),
        ({"task": "acoustic_edit", "instruction": "shift the pitch by 0 steps", "text": "", "audio": CLIP},
         "INSTRUCTION", "pitch"),
    ],
)  # fmt: skip
def test_refused_combinations_name_the_input(kw, field, words):
    with pytest.raises(ValueError) as e:
        ask(**kw)
    assert field in str(e.value) and words in str(e.value), str(e.value)


def test_thirty_seconds_is_the_edit_limit_at_any_rate():
    for rate in (8000, 24000, 44100):
        edit = instruct_of(parse_request(TTSInputs("", None, np.zeros(30 * rate, np.float32), rate,
                                                   task="acoustic_edit", instruction="adjust the volume to 0.5")).utterance)  # fmt: skip
        assert edit == ("acoustic_edit", "adjust the volume to 0.5")
        with pytest.raises(ValueError, match="REF_AUDIO is 30.0 s"):  # one sample over
            parse_request(TTSInputs("", None, np.zeros(30 * rate + 1, np.float32), rate, task="acoustic_edit",
                                    instruction="adjust the volume to 0.5"))  # fmt: skip


EDIT = {"text": "", "ref_audio": CLIP, "ref_sample_rate": RATE}  # an edit's recording


@pytest.mark.parametrize(
    "inputs, seed, cfg",
    [(TTSInputs("Hi.", task="design", instruction="a calm voice"), 2, 1.2),
     (TTSInputs("Hi.", voice_id="alice", task="clone"), 1234, 2.0),
     (TTSInputs(**EDIT, task="semantic_edit", instruction="Delete 'a'."), 1234, 1.2),
     (TTSInputs(**EDIT, task="acoustic_edit", instruction="adjust the volume to 0.5"), 1234, 1.2)],
)  # fmt: skip
def test_the_release_defaults_reach_the_generation_settings(inputs, seed, cfg):
    """The release's seed and cfg per task (core.py) when the client gives none; the client's otherwise."""
    params = parse_request(inputs).utterance.params
    assert (params.seed, params.cfg) == (seed, cfg)
    params = parse_request(dataclasses.replace(inputs, seed=7, parameters={"cfg": 3.5, "steps": 4})).utterance.params
    assert (params.seed, params.cfg, params.steps) == (7, 3.5, 4)


def test_base_keeps_its_defaults():
    params = parse_request(TTSInputs("Hi.")).utterance.params
    assert (params.seed, params.cfg) == (1234, 2.0)


texts = st.none() | st.text(max_size=8) | st.integers() | st.sampled_from(["", " ", "a calm man", "Delete 'a'."])
audio = st.none() | st.sampled_from([CLIP, np.full(RATE, 2.0, np.float32), np.zeros(0, np.float32)])


@settings(deadline=None, max_examples=400)
@given(st.none() | st.sampled_from(["speak", "clone", "design", "semantic_edit", "acoustic_edit", "x"]), texts,
       texts, audio, st.none() | st.sampled_from([RATE, 0, -1, 10**12]), texts, texts)  # fmt: skip
def test_any_combination_is_a_task_or_an_error_naming_an_input(task, instruction, text, audio, rate, ref_text, voice):
    try:
        result = instruct_request(
            TTSInputs(text, None, audio, rate, ref_text, voice, task=task, instruction=instruction)
        )
    except ValueError as e:
        assert any(name in str(e) for name in INPUTS), str(e)
        return
    task, instruction = result
    assert result == BASE or task in ("clone", "design", "semantic_edit", "acoustic_edit")
    if task not in ("", "clone"):
        assert instruction and instruction == instruction.strip()
