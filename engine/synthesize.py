"""Offline synthesis: text (+ optional reference voice) -> 24 kHz mono audio.

This is the reference path the streaming server is checked against: it runs the same generator step
and the same primed, chunked decoder as a server stream.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from engine import audio as A
from engine.config import SAMPLE_RATE
from engine.generator import GenerationParams
from engine.pipeline import FireRedTTS3
from engine.prompt import VoicePrompt
from engine.segments import Joiner, segment_schedule, split_text
from engine.service import GeneratorService

DEFAULT_SCHEDULE = (3, 12)  # patches per chunk: first chunk, then every later chunk
DEFAULT_SPLIT_TOKENS = 80  # longer texts are synthesized sentence group by sentence group


def stream_audio(
    tts: FireRedTTS3,
    text: str,
    language: str = "English",
    prompt: VoicePrompt | None = None,
    params: GenerationParams = GenerationParams(),
    schedule: Sequence[int] = DEFAULT_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
) -> Iterator[np.ndarray]:
    """Yield float32 audio chunks of one utterance as they are decoded (one stream, batch of 1).

    A text longer than ``split_tokens`` tokens is cut into segments at sentence ends; each segment is
    generated with the same seed and joined to the previous one with a 50 ms cross-fade.
    """
    prompt = prompt or tts.encode_prompt(None)
    tokenizer = tts.models.tokenizer
    segments = split_text(text, lambda t: len(tokenizer.encode(t)), split_tokens)
    joiner = Joiner()
    for i, segment in enumerate(segments):
        more = i < len(segments) - 1
        joiner.start_segment()
        for chunk in _segment_audio(tts, segment, language, prompt, params, segment_schedule(i, tuple(schedule))):
            out = joiner.push(chunk, more)
            if out.size or not more:
                yield out
    rest = joiner.finish()
    if rest.size:
        yield rest


def _segment_audio(tts, text, language, prompt, params, schedule) -> Iterator[np.ndarray]:
    """One segment through the server's own stream machinery, in-process with a single slot."""
    tokens = tts.tokens(text, language, prompt)
    gen = GeneratorService(tts, slots=1, max_len=1 + len(tokens) + prompt.num_patches + params.max_patches)
    gen.admit(0, tokens, prompt, params, schedule)
    decoder = tts.decoder_stream(prompt.latents)
    while True:
        emitted = gen.step([0])[0]
        if emitted.latents is not None:
            yield decoder.decode(torch.from_numpy(emitted.latents))
        if emitted.finished:
            break
    yield decoder.finish()


def synthesize(
    tts: FireRedTTS3,
    text: str,
    language: str = "English",
    ref_audio: np.ndarray | None = None,
    ref_sample_rate: int = SAMPLE_RATE,
    ref_text: str = "",
    params: GenerationParams = GenerationParams(),
    schedule: Sequence[int] = DEFAULT_SCHEDULE,
    split_tokens: int = DEFAULT_SPLIT_TOKENS,
) -> np.ndarray:
    """Whole utterance as one float32 array at 24 kHz: patches * 3840 samples per text segment, minus
    the 1200-sample cross-fade between segments.

    Without ``ref_audio`` the voice prompt is one patch of silence (the model then picks a voice).
    """
    prompt = tts.encode_prompt(ref_audio, ref_sample_rate, ref_text) if ref_audio is not None else None
    return np.concatenate(list(stream_audio(tts, text, language, prompt, params, schedule, split_tokens)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.synthesize",
        description="Synthesize one utterance offline to a 24 kHz mono WAV. Without --ref-audio the voice "
        "prompt is a short silence, so the (random or real) model picks a voice on its own.",
    )
    ap.add_argument("--checkpoint", required=True, type=Path, help="folder in the official FireRedTTS3 layout")
    ap.add_argument("--text", required=True, help="text to speak ('-' reads stdin)")
    ap.add_argument("--language", default="English")
    ap.add_argument("--ref-audio", type=Path, help="reference voice clip (any rate; first channel is used)")
    ap.add_argument("--ref-text", default="", help="transcript of --ref-audio")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=10, help="Euler steps of the flow head")
    ap.add_argument("--cfg", type=float, default=2.0, help="classifier-free guidance weight")
    ap.add_argument("--max-patches", type=int, default=400, help="length limit per text segment, in 160 ms patches")
    ap.add_argument(
        "--split-tokens", type=int, default=DEFAULT_SPLIT_TOKENS, help="split longer texts at sentences (0: never)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.ref_text and not args.ref_audio:
        ap.error("--ref-text needs --ref-audio")
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        params = GenerationParams(seed=args.seed, steps=args.steps, cfg=args.cfg, max_patches=args.max_patches)
        t0 = time.perf_counter()
        tts = FireRedTTS3.from_checkpoint(args.checkpoint, device=args.device)
        t1 = time.perf_counter()
        ref = A.load_audio(args.ref_audio) if args.ref_audio else (None, SAMPLE_RATE)
        wav = synthesize(
            tts, text, args.language, ref[0], ref[1], args.ref_text, params, split_tokens=args.split_tokens
        )
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    A.write_wav(args.out, wav, SAMPLE_RATE)
    dur = len(wav) / SAMPLE_RATE
    print(
        f"wrote {args.out}: {dur:.2f} s of audio ({len(wav)} samples); load {t1 - t0:.2f} s, "
        f"synthesis {t2 - t1:.2f} s, RTF {(t2 - t1) / max(dur, 1e-9):.3f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
