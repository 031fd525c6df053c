"""Offline synthesis: text (+ optional reference voice) -> 24 kHz mono audio.

This is the reference path the streaming server is checked against: it runs the same generator step
and the same primed, chunked decoder as a server stream.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from engine.audio import load_audio, write_wav
from engine.chunking import ChunkSchedule
from engine.fireredtts3 import FireRedTTS3
from engine.frontend.language import use_lid_model
from engine.instruct import DEFAULTS, EDITS, Task, check_edit_length
from engine.instructions import task_instruction
from engine.local import local_orchestrator
from engine.orchestrator import Utterance
from engine.params import (
    CFG,
    DEFAULT_SCHEDULE,
    DEFAULT_SEED,
    DEFAULT_SPLIT_TOKENS,
    READ_AHEAD,
    SPEED,
    UTTERANCE_PARAMETERS,
    GenerationParams,
    generation_params,
    parse_parameters,
)
from engine.prompt import VoicePrompt
from engine.protocol import SAMPLE_RATE, StreamFailed

# Offline there is no listener to keep up with, and chunk sizes move the decoder's float32 rounding (by
# up to ~1e-7: its attention runs over chunk-long blocks): a fixed schedule gives the same request the
# same samples on every run, where the deadline rule's chunks follow the machine's speed.
OFFLINE_SCHEDULE = replace(DEFAULT_SCHEDULE, fixed=True)


def stream_audio(
    model: FireRedTTS3,
    text: str,
    language: str | None = None,
    prompt: VoicePrompt | None = None,
    params: GenerationParams = GenerationParams(),
    schedule: ChunkSchedule = OFFLINE_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    normalize: bool = True,
    speed: float = SPEED.default,
    read_ahead: int = READ_AHEAD.default,
) -> Iterator[np.ndarray]:
    """Yield float32 audio chunks of one utterance as they are decoded (one stream, batch of 1).

    This is the server's orchestration run in-process: the text goes through the front end
    (:func:`engine.frontend.prepare`: cleaning, language detection when ``language`` is None, sentence
    grouping by ``split_tokens``, normalization unless ``normalize`` is False), and each segment is
    generated with the same seed and joined with a 50 ms cross-fade, then played ``speed`` times as fast
    at the same pitch (:mod:`engine.time_stretch`). ``read_ahead`` segments generate at once (on as many
    slots, each stepped alone: the same samples as one after another). Raises ValueError for bad input.
    """
    utterance = Utterance(text, language, params, schedule, split_tokens, normalize, speed, read_ahead=read_ahead)
    for piece in _pieces(local_orchestrator(model, slots=read_ahead), utterance, prompt):
        if piece.audio.size or piece.final:
            yield piece.audio


def _pieces(orchestrator, utterance: Utterance, voice) -> Iterator:
    """The orchestrator's pieces of one utterance, run on a private event loop."""
    pieces = orchestrator.run(utterance, voice)
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(pieces))
            except StopAsyncIteration:
                return
    except StreamFailed as e:
        raise (ValueError if e.invalid else RuntimeError)(str(e)) from None
    finally:
        loop.run_until_complete(pieces.aclose())
        loop.close()


def synthesize(
    model: FireRedTTS3,
    text: str,
    language: str | None = None,
    ref_audio: np.ndarray | None = None,
    ref_sample_rate: int = SAMPLE_RATE,
    ref_text: str = "",
    params: GenerationParams = GenerationParams(),
    schedule: ChunkSchedule = OFFLINE_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    normalize: bool = True,
    speed: float = SPEED.default,
    read_ahead: int = READ_AHEAD.default,
) -> np.ndarray:
    """Whole utterance as one float32 array at 24 kHz: patches * 3840 samples per text segment, minus
    the 1200-sample cross-fade between segments, divided by ``speed`` (rounded).

    Without ``ref_audio`` the voice prompt is one patch of silence (the model then picks a voice).
    """
    prompt = model.encode_prompt(ref_audio, ref_sample_rate, ref_text) if ref_audio is not None else None
    chunks = stream_audio(model, text, language, prompt, params, schedule, split_tokens, normalize, speed, read_ahead)
    return np.concatenate(list(chunks))


@dataclass(frozen=True)
class InstructResult:
    """One Instruct task run offline, with what each generator stream was given and made."""

    audio: np.ndarray  # (n,) float32 at 24 kHz: the segments joined as a server streams them
    plan_text: str  # the first segment's plan (design), the new transcript (semantic edit); else ""
    chatml_token_ids: list[list[int]]  # per segment: the ChatML ids the backbone was given
    plan_token_ids: list[list[int]]  # per segment: the text phase's ids, <|eot|> excluded ([] without one)
    latents: list[np.ndarray]  # per segment: (4 * patches, 64) float32 generated latents, RedAE's scale


def instruct_run(
    model: FireRedTTS3,
    task: Task | str,
    text: str = "",
    instruction: str = "",
    audio: np.ndarray | None = None,
    sample_rate: int = SAMPLE_RATE,
    prompt_text: str = "",
    seed: int | None = None,
    cfg: float | None = None,
    steps: int = 10,
    max_patches: int = 400,
    language: str | None = None,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    normalize: bool = True,
    schedule: ChunkSchedule = OFFLINE_SCHEDULE,
    speed: float = SPEED.default,
    read_ahead: int = READ_AHEAD.default,
) -> InstructResult:
    """Run one FireRedTTS3-Instruct task in this process, as a server streams it.

    Args:
        task: ``design`` (``instruction`` + ``text``), ``clone`` (``audio`` + ``prompt_text`` + ``text``),
            ``semantic_edit`` or ``acoustic_edit`` (``instruction`` + ``audio``, the recording to edit).
        audio: (N,) float samples at ``sample_rate``: the cloning prompt or the recording to edit.
        seed, cfg: None = the task's defaults (the reference's: seed 2 and cfg 1.2 for design, 1234 and
            2.0 for cloning, 1234 and 1.2 for edits).
        language, split_tokens, normalize: the text front end (design and clone), as for Base.
        speed: the speaking rate, as for Base (the latents are the model's, at 1.0).
        read_ahead: segments generating at once, as for Base (the same result).
    Raises:
        ValueError: bad input (the message names it).
    """
    task = Task.parse(task) if isinstance(task, str) else task
    defaults = DEFAULTS[task]
    params = GenerationParams(
        seed=defaults.seed if seed is None else seed, steps=steps, cfg=defaults.cfg if cfg is None else cfg,
        max_patches=max_patches, min_patches=min(GenerationParams.min_patches, max_patches),
    )  # fmt: skip
    voice = None
    if task is not Task.DESIGN:
        if audio is None:
            raise ValueError(
                f"the {task.value} task needs audio (the {'prompt' if task is Task.CLONE else 'recording'})"
            )
        if task in EDITS:
            check_edit_length(len(audio), sample_rate)
        voice = VoicePrompt(model.encode_latents(audio, sample_rate), torch.zeros(0), prompt_text)
    instruction = task_instruction(task.value, instruction)  # this entry point's check: the orchestrator trusts it
    orchestrator = local_orchestrator(model, slots=read_ahead)
    streams, latents = [], {}
    orchestrator.generator.on_admit = lambda segment, state: streams.append((segment.stream_id, state))
    orchestrator.generator.on_chunk = lambda chunk: latents.setdefault(chunk.stream_id, []).append(chunk.latents)
    utterance = Utterance(text, language, params, schedule, split_tokens, normalize, speed,
                          task=task.value, instruction=instruction, read_ahead=read_ahead)  # fmt: skip
    try:
        pieces = list(_pieces(orchestrator, utterance, voice))
    except StreamFailed as e:
        raise (ValueError if e.invalid else RuntimeError)(str(e)) from None
    return InstructResult(
        audio=np.concatenate([p.audio for p in pieces]),
        plan_text=next((p.text for p in pieces if p.text is not None), ""),
        chatml_token_ids=[state.tokens[0].tolist() for _, state in streams],
        plan_token_ids=[list(state.text_ids) for _, state in streams],
        latents=[np.concatenate(latents.get(sid, [])) for sid, _ in streams],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.synthesize",
        description="Synthesize one utterance offline to a 24 kHz mono WAV. Without --ref-audio the voice "
        "prompt is a short silence, so the (random or real) model picks a voice on its own.",
    )
    ap.add_argument("--checkpoint", required=True, type=Path, help="folder in the official FireRedTTS3 layout")
    ap.add_argument("--text", help="text to speak ('-' reads stdin); not with --edit")
    ap.add_argument("--language", help="language or dialect name (default: detected from the text)")
    ap.add_argument("--lid-model", type=Path, help="fastText language-id model used for detection "
                    "(needs the fasttext package; default: by script, as the reference without one)")  # fmt: skip
    ap.add_argument("--ref-audio", type=Path, help="reference voice clip (any rate; channels are averaged)")
    ap.add_argument("--ref-text", default="", help="transcript of --ref-audio")
    ap.add_argument("--instruction", help="FireRedTTS3-Instruct: a voice description (voice design; "
                    "with --ref-audio: Instruct cloning, whose input has no place for it) or, with --edit, "
                    "the edit instruction")  # fmt: skip
    ap.add_argument("--edit", choices=["semantic", "acoustic"], help="edit --recording with --instruction "
                    "(Instruct): its words, or its speed / pitch / volume")  # fmt: skip
    ap.add_argument("--recording", type=Path, help="the recording to --edit")
    ap.add_argument("--seed", type=int, help=f"default {DEFAULT_SEED}; Instruct: the task's (2 for design)")
    for p in UTTERANCE_PARAMETERS:
        flag = f"--{p.name.replace('_', '-')}"
        if p.type is bool:  # --normalize / --no-normalize
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=p.default, help=p.doc)
        elif p is CFG:  # Instruct's tasks have their own default
            ap.add_argument(flag, type=p.type, help=f"{p.doc} (default {p.default}; Instruct: 1.2, cloning 2.0)")
        else:
            ap.add_argument(flag, type=p.type, default=p.default, help=f"{p.doc} (default {p.default})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.ref_text and not args.ref_audio:
        ap.error("--ref-text needs --ref-audio")
    if args.edit and (not args.recording or args.instruction is None or args.text or args.ref_audio):
        ap.error("--edit takes --recording and --instruction (and no --text or --ref-audio)")
    if not args.edit and (args.recording or not args.text):
        ap.error("--text is required (--recording goes with --edit)")
    task = None
    if args.edit:
        task = Task.SEMANTIC_EDIT if args.edit == "semantic" else Task.ACOUSTIC_EDIT
    elif args.instruction is not None:
        task = Task.CLONE if args.ref_audio else Task.DESIGN
    text = sys.stdin.read() if args.text == "-" else (args.text or "")
    try:
        given = {p.name: getattr(args, p.name) for p in UTTERANCE_PARAMETERS}
        given["cfg"] = given["cfg"] if given["cfg"] is not None else DEFAULTS[task].cfg if task else CFG.default
        values = parse_parameters(given)
        seed = args.seed if args.seed is not None else DEFAULTS[task].seed if task else DEFAULT_SEED
        params, schedule = generation_params(seed, values)
        schedule = replace(schedule, fixed=True)  # offline: the same samples every run (OFFLINE_SCHEDULE)
        if task is not None:
            return _instruct_main(args, task, text, params, schedule, values)
        if args.lid_model:
            try:
                use_lid_model(args.lid_model)
            except RuntimeError as e:  # no fasttext package
                raise ValueError(str(e)) from None
        t0 = time.perf_counter()
        model = FireRedTTS3.from_checkpoint(args.checkpoint, device=args.device)
        t1 = time.perf_counter()
        ref = load_audio(args.ref_audio) if args.ref_audio else (None, SAMPLE_RATE)
        wav = synthesize(
            model, text, args.language, ref[0], ref[1], args.ref_text, params, schedule, values["split_tokens"],
            values["normalize"], values["speed"], values["read_ahead"],
        )  # fmt: skip
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _written(args.out, wav, t1 - t0, t2 - t1)


def _written(out, wav, load: float, synthesis: float, what: str = "") -> int:
    """Write the WAV and say what it took (stderr)."""
    write_wav(out, wav, SAMPLE_RATE)
    dur = len(wav) / SAMPLE_RATE
    print(f"wrote {out}: {dur:.2f} s of audio ({len(wav)} samples{what}); load {load:.2f} s, "
          f"synthesis {synthesis:.2f} s, RTF {synthesis / max(dur, 1e-9):.3f}", file=sys.stderr)  # fmt: skip
    return 0


def _instruct_main(args, task: Task, text: str, params: GenerationParams, schedule, values: dict) -> int:
    t0 = time.perf_counter()
    model = FireRedTTS3.from_checkpoint(args.checkpoint, device=args.device)
    t1 = time.perf_counter()
    audio, rate = load_audio(args.recording or args.ref_audio) if (args.recording or args.ref_audio) else (None, 0)
    result = instruct_run(
        model, task, text, args.instruction or "", audio, rate or SAMPLE_RATE, args.ref_text, params.seed, params.cfg,
        params.steps, params.max_patches, args.language, values["split_tokens"], values["normalize"], schedule,
        values["speed"], values["read_ahead"],
    )  # fmt: skip
    t2 = time.perf_counter()
    wav = result.audio
    if task in (Task.DESIGN, Task.SEMANTIC_EDIT):
        print(f"plan: {result.plan_text}")
    return _written(args.out, wav, t1 - t0, t2 - t1, f", Instruct {task.value}")


if __name__ == "__main__":
    raise SystemExit(main())
