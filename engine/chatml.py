"""The ChatML inputs of FireRedTTS3-Instruct's four tasks, character for character as the release builds them.

Every task is one chat: a fixed system turn, a user turn (optionally an audio block of the recording to
edit, then the request, then Qwen3's `` /no_think``), and an assistant turn opened with Qwen3's empty
think block and left open where the model takes over::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n[<|sosp|>{<|image_pad|> per patch}<|eosp|>\\n]{request} /no_think<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n{opening}

The opening is ``<|sot|>`` when the model writes text first (voice design, semantic edit), ``<|sosp|>``
when it speaks at once (acoustic edit), and ``<|sosp|>`` followed by one ``<|video_pad|>`` per patch of
the cloning prompt (Instruct cloning), which the audio phase continues. The placeholders are later
replaced by PatchEncoder outputs; the strings are tokenized with ``engine.text.TextTokenizer.encode``
(no special tokens added). The release ships a single one-sentence Chinese request for voice design; the
other requests are English.

The composers refuse texts that carry ChatML control tokens (see :mod:`engine.instructions`): a text
could otherwise close the user turn or add placeholders, and the patch count would no longer match.
"""

from __future__ import annotations

import argparse
import sys

from engine.instructions import control_token_error

LATENT_IN_ID = 151655  # <|image_pad|>: one per patch of the audio to edit (filled with PatchEncoder outputs)
LATENT_OUT_ID = 151656  # <|video_pad|>: one per patch of the cloning prompt
AUDIO_SOS_ID = 151669  # <|sosp|>: the audio phase starts after it
TEXT_EOT_ID = 151677  # <|eot|>: ends the text phase
MAX_TEXT_TOKENS = 200  # the text phase's cap (the reference stops after this many tokens even without <|eot|>)

LATENT_IN = "<|image_pad|>"
LATENT_OUT = "<|video_pad|>"
AUDIO_START = "<|sosp|>"
AUDIO_END = "<|eosp|>"
TEXT_START = "<|sot|>"

SYSTEM_TURN = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
NO_THINK = " /no_think"  # Qwen3's switch for answering without reasoning
ASSISTANT_OPENING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
CLONE_REQUEST = "Convert text to speech.\n"
# "Following the voice description above, first work out the voice attributes, then synthesize the
# audio of this text:" — the wording the model was trained on.
DESIGN_REQUEST = "\n\n根据上述音色描述，首先整理成语音属性，再合成以下文本对应的音频：\n"
SEMANTIC_EDIT_REQUEST = "Identify the content of the audio. "


def clone_chatml(prompt_patches: int, prompt_text: str, text: str) -> str:
    """Instruct cloning: speak ``text`` in the voice of a prompt of ``prompt_patches`` patches.

    ``prompt_text`` (the prompt's transcript) and ``text`` are joined with no separator, as for Base.
    The string ends inside the open audio block, after the prompt's placeholders.
    """
    _check_patches(prompt_patches, "prompt_patches")
    request = _checked(prompt_text + text, "text")
    return _chat(CLONE_REQUEST + request, "", AUDIO_START + LATENT_OUT * prompt_patches)


def design_chatml(instruction: str, text: str) -> str:
    """Voice design: the model writes a voice plan for ``instruction`` after ``<|sot|>``, then speaks ``text``.

    The instruction goes in as given (the reference strips it only for semantic edits).
    """
    _checked(instruction, "instruction")
    _checked(text, "text")
    return _chat(instruction + DESIGN_REQUEST + text, "", TEXT_START)


def semantic_edit_chatml(instruction: str, patches: int) -> str:
    """Semantic edit of a recording of ``patches`` patches: the model writes the edited transcript after
    ``<|sot|>``, then speaks it. The instruction is stripped of outer whitespace, as the reference does."""
    _check_patches(patches, "patches")
    request = SEMANTIC_EDIT_REQUEST + _checked(instruction, "instruction").strip()
    return _chat(request, _audio_block(patches), TEXT_START)


def acoustic_edit_chatml(instruction: str, patches: int) -> str:
    """Acoustic edit (speed, pitch, volume) of a recording of ``patches`` patches: the instruction is the
    whole request (one of :data:`engine.instructions.ACOUSTIC_TEMPLATES`); the model speaks at once."""
    _check_patches(patches, "patches")
    return _chat(_checked(instruction, "instruction"), _audio_block(patches), AUDIO_START)


def _chat(request: str, audio_in: str, opening: str) -> str:
    user_turn = f"<|im_start|>user\n{audio_in}{request}{NO_THINK}<|im_end|>\n"
    return SYSTEM_TURN + user_turn + ASSISTANT_OPENING + opening


def _audio_block(patches: int) -> str:
    return f"{AUDIO_START}{LATENT_IN * patches}{AUDIO_END}\n"


def _check_patches(patches: int, name: str) -> None:
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {patches!r}")


def _checked(text: str, field: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    problem = control_token_error(text)
    if problem:
        raise ValueError(f"{field} {problem}")
    return text


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.chatml TASK ...``: print the ChatML string of a task (a debugging aid)."""
    parser = argparse.ArgumentParser(prog="python -m engine.chatml", description=main.__doc__)
    tasks = parser.add_subparsers(dest="task", required=True)
    clone = tasks.add_parser("clone", help="Instruct cloning")
    clone.add_argument("prompt_patches", type=int)
    clone.add_argument("prompt_text")
    clone.add_argument("text")
    design = tasks.add_parser("design", help="voice design")
    design.add_argument("instruction")
    design.add_argument("text")
    for name in ("semantic-edit", "acoustic-edit"):
        edit = tasks.add_parser(name, help=name.replace("-", " "))
        edit.add_argument("instruction")
        edit.add_argument("patches", type=int)
    args = parser.parse_args(argv)
    try:
        if args.task == "clone":
            out = clone_chatml(args.prompt_patches, args.prompt_text, args.text)
        elif args.task == "design":
            out = design_chatml(args.instruction, args.text)
        elif args.task == "semantic-edit":
            out = semantic_edit_chatml(args.instruction, args.patches)
        else:
            out = acoustic_edit_chatml(args.instruction, args.patches)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    sys.stdout.write(out + "\n")


if __name__ == "__main__":
    main()
