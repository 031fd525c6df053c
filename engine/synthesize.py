"""Offline synthesis: text (+ optional reference voice) -> 24 kHz mono audio.

This is the reference path the streaming server is checked against: it runs the same generator step
and the same primed, chunked decoder as a server stream.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from engine.audio import load_audio, write_wav
from engine.fireredtts3 import FireRedTTS3
from engine.frontend.language import use_lid_model
from engine.local import local_orchestrator
from engine.orchestrator import Utterance
from engine.params import (
    DEFAULT_SCHEDULE,
    DEFAULT_SEED,
    DEFAULT_SPLIT_TOKENS,
    SPEED,
    UTTERANCE_PARAMETERS,
    GenerationParams,
    generation_params,
    parse_parameters,
)
from engine.prompt import VoicePrompt
from engine.protocol import SAMPLE_RATE, StreamFailed


def stream_audio(
    model: FireRedTTS3,
    text: str,
    language: str | None = None,
    prompt: VoicePrompt | None = None,
    params: GenerationParams = GenerationParams(),
    schedule: Sequence[int] = DEFAULT_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    normalize: bool = True,
    speed: float = SPEED.default,
) -> Iterator[np.ndarray]:
    """Yield float32 audio chunks of one utterance as they are decoded (one stream, batch of 1).

    This is the server's orchestration run in-process: the text goes through the front end
    (:func:`engine.frontend.prepare`: cleaning, language detection when ``language`` is None, sentence
    grouping by ``split_tokens``, normalization unless ``normalize`` is False), and each segment is
    generated with the same seed and joined with a 50 ms cross-fade, then played ``speed`` times as fast
    at the same pitch (:mod:`engine.time_stretch`). Raises ValueError for bad input.
    """
    utterance = Utterance(text, language, params, tuple(schedule), split_tokens, normalize, speed)
    pieces = local_orchestrator(model).run(utterance, prompt)
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                piece = loop.run_until_complete(anext(pieces))
            except StopAsyncIteration:
                return
            if piece.audio.size or piece.final:
                yield piece.audio
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
    schedule: Sequence[int] = DEFAULT_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
    normalize: bool = True,
    speed: float = SPEED.default,
) -> np.ndarray:
    """Whole utterance as one float32 array at 24 kHz: patches * 3840 samples per text segment, minus
    the 1200-sample cross-fade between segments, divided by ``speed`` (rounded).

    Without ``ref_audio`` the voice prompt is one patch of silence (the model then picks a voice).
    """
    prompt = model.encode_prompt(ref_audio, ref_sample_rate, ref_text) if ref_audio is not None else None
    chunks = stream_audio(model, text, language, prompt, params, schedule, split_tokens, normalize, speed)
    return np.concatenate(list(chunks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.synthesize",
        description="Synthesize one utterance offline to a 24 kHz mono WAV. Without --ref-audio the voice "
        "prompt is a short silence, so the (random or real) model picks a voice on its own.",
    )
    ap.add_argument("--checkpoint", required=True, type=Path, help="folder in the official FireRedTTS3 layout")
    ap.add_argument("--text", required=True, help="text to speak ('-' reads stdin)")
    ap.add_argument("--language", help="language or dialect name (default: detected from the text)")
    ap.add_argument("--lid-model", type=Path, help="fastText language-id model used for detection "
                    "(needs the fasttext package; default: by script, as the reference without one)")  # fmt: skip
    ap.add_argument("--ref-audio", type=Path, help="reference voice clip (any rate; channels are averaged)")
    ap.add_argument("--ref-text", default="", help="transcript of --ref-audio")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    for p in UTTERANCE_PARAMETERS:
        flag = f"--{p.name.replace('_', '-')}"
        if p.type is bool:  # --normalize / --no-normalize
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=p.default, help=p.doc)
        else:
            ap.add_argument(flag, type=p.type, default=p.default, help=f"{p.doc} (default {p.default})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.ref_text and not args.ref_audio:
        ap.error("--ref-text needs --ref-audio")
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        values = parse_parameters({p.name: getattr(args, p.name) for p in UTTERANCE_PARAMETERS})
        params, schedule = generation_params(args.seed, values)
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
            values["normalize"], values["speed"],
        )  # fmt: skip
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_wav(args.out, wav, SAMPLE_RATE)
    dur = len(wav) / SAMPLE_RATE
    print(
        f"wrote {args.out}: {dur:.2f} s of audio ({len(wav)} samples); load {t1 - t0:.2f} s, "
        f"synthesis {t2 - t1:.2f} s, RTF {(t2 - t1) / max(dur, 1e-9):.3f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
