"""``python -m client``: speak text through the server into a WAV file, or as raw PCM to stdout.

    python -m client --url 127.0.0.1:8001 --text "Hello" --out hello.wav
    echo "Hello" | python -m client --text - --out - | aplay -f S16_LE -r 24000 -c 1

Progress and the summary (first-chunk latency, total time, real-time factor) go to stderr; stdout carries
only audio. A failed request exits with status 1 and the server's message on stderr.

Subcommands (``python -m client --url U NAME ...``) come from :data:`COMMANDS`; with none given the
CLI synthesizes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from client.audio_io import WavWriter, read_audio, write_pcm
from client.request import TTSError
from client.tts_client import TTSClient
from engine.params import DEFAULT_SEED
from engine.protocol import SAMPLE_RATE
from serving.contract import TTS_PARAMETERS


@dataclass(frozen=True)
class Command:
    """A subcommand of the CLI."""

    help: str  # one line for ``--help``
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its own options (may add nested subparsers)
    run: Callable[[argparse.Namespace], int]  # gets the whole namespace (--url, --protocol, --timeout too)


COMMANDS: dict[str, Command] = {}  # name -> subcommand


def _register_voices() -> None:
    from client import voices

    COMMANDS["voices"] = Command(voices.HELP, voices.add_arguments, voices.run)


_register_voices()


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    commands = COMMANDS if commands is None else commands
    ap = argparse.ArgumentParser(
        prog="python -m client", epilog="Progress and the summary go to stderr; stdout carries only audio.",
        description="Speak text through the FireRedTTS3 server into a WAV file, or as raw PCM to stdout.",
    )  # fmt: skip
    ap.add_argument("--url", help="server HOST:PORT (default: 127.0.0.1 and 8001 for gRPC, 8000 for HTTP)")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="default: grpc")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each response (default: 60)")

    syn = ap.add_argument_group("synthesize (the default when no command is given)")
    syn.add_argument("--text", help="text to speak; '-' reads it from stdin")
    syn.add_argument("--language", help="language or dialect name (server default: detected from the text)")
    voice = syn.add_mutually_exclusive_group()
    voice.add_argument("--voice-id", help="a voice registered on the server")
    voice.add_argument("--ref-audio", help="reference voice recording (any format libsndfile reads)")
    syn.add_argument("--ref-text", help="transcript of --ref-audio")
    syn.add_argument("--seed", type=int, help=f"sampling seed (server default: {DEFAULT_SEED})")
    syn.add_argument(
        "--model", choices=["tts", "tts_ensemble"], default="tts",
        help="entry point: tts (BLS; long texts, cancellation) or tts_ensemble (plain Triton ensemble, one "
        "segment, no split_tokens); default tts",
    )  # fmt: skip
    syn.add_argument("--out", help="output .wav (24 kHz mono 16-bit), or '-' for raw s16le PCM on stdout")
    syn.add_argument("--quiet", "-q", action="store_true", help="no progress or summary on stderr")
    par = ap.add_argument_group("request parameters (server defaults when omitted)")
    for p in TTS_PARAMETERS:
        flag = f"--{p.name.replace('_', '-')}"
        if p.type is bool:  # --normalize / --no-normalize; omitted: the server's default
            par.add_argument(flag, action=argparse.BooleanOptionalAction, help=f"{p.doc} (default {p.default})")
        else:
            par.add_argument(flag, type=p.type, help=f"{p.doc} (default {p.default})")

    if commands:
        sub = ap.add_subparsers(dest="command", metavar="COMMAND")
        for name, cmd in commands.items():
            cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    ap.set_defaults(command=None)
    return ap


def main(argv: list[str] | None = None, commands: dict[str, Command] | None = None) -> int:
    commands = COMMANDS if commands is None else commands
    ap = build_parser(commands)
    args = ap.parse_args(argv)
    if args.command is not None:
        return commands[args.command].run(args)
    if args.text is None or args.out is None:
        ap.error("synthesizing needs --text and --out")
    if args.ref_text is not None and args.ref_audio is None:
        ap.error("--ref-text needs --ref-audio")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    text = sys.stdin.read().strip() if args.text == "-" else args.text
    request = {"language": args.language, "voice_id": args.voice_id, "ref_text": args.ref_text, "seed": args.seed}
    if args.ref_audio is not None:
        try:
            request["ref_audio"], request["ref_sample_rate"] = read_audio(args.ref_audio)
        except Exception as e:  # libsndfile's errors are not OSError; any of them means: unreadable
            ap.error(f"cannot read --ref-audio {args.ref_audio}: {e}")
    request["parameters"] = {p.name: getattr(args, p.name) for p in TTS_PARAMETERS if getattr(args, p.name) is not None}
    client = TTSClient(args.url or "127.0.0.1", args.protocol, timeout=args.timeout, model=args.model)
    return synthesize(client, text, request, args.out, quiet=args.quiet)


def synthesize(client: TTSClient, text: str, request: dict, out: str, quiet: bool = False) -> int:
    """Stream into ``out`` ('-': stdout as s16le); returns the exit status."""
    try:
        sink = _PcmSink(sys.stdout.buffer) if out == "-" else WavWriter(out)
    except OSError as e:
        print(f"error: cannot write {out}: {e}", file=sys.stderr)
        return 1
    progress = _Progress(sys.stderr, enabled=not quiet)
    try:
        with contextlib.closing(client.stream(text, **request)) as chunks:  # closing early cancels the request
            for chunk in chunks:
                sink.write(chunk.audio)
                progress.chunk(chunk)
    except BrokenPipeError:  # the reader of --out - went away (e.g. the player was closed)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except (TTSError, ConnectionError, TimeoutError) as e:
        progress.end()
        print(f"error: {e}", file=sys.stderr)
        _discard(sink, out)
        return 1
    except KeyboardInterrupt:
        progress.end()
        _discard(sink, out)
        return 130
    sink.close()
    progress.summary(out)
    return 0


def _discard(sink, out: str) -> None:
    """A failed request leaves no half-written WAV behind."""
    sink.close()
    if out != "-":
        os.unlink(out)


class _PcmSink:
    def __init__(self, stream):
        self.stream = stream

    def write(self, audio) -> None:
        write_pcm(self.stream, audio)

    def close(self) -> None:
        self.stream.flush()


class _Progress:
    """Chunks and audio seconds so far on one line (rewritten in place on a terminal), then a summary."""

    def __init__(self, stream, enabled: bool = True):
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self.chunks, self.samples, self.first = 0, 0, None

    def chunk(self, chunk) -> None:
        self.chunks += 1
        self.samples += chunk.audio.size
        self.first = chunk.arrival if self.first is None else self.first
        if self.enabled:
            end = "" if self.tty else "\n"
            line = f"chunk {self.chunks}: {self.samples / SAMPLE_RATE:.2f} s of audio at {chunk.arrival:.2f} s"
            print(f"\r{line}\033[K" if self.tty else line, end=end, file=self.stream, flush=True)

    def end(self) -> None:
        if self.tty and self.chunks:
            print(file=self.stream)

    def summary(self, out: str) -> None:
        self.end()
        if not self.enabled:
            return
        total = time.perf_counter() - self.t0
        audio = self.samples / SAMPLE_RATE
        rtf = f"{total / audio:.3f}" if audio else "n/a"
        first = f"{self.first:.3f} s" if self.first is not None else "n/a (no audio)"
        where = "stdout (s16le, 24 kHz mono)" if out == "-" else f"{out} (24 kHz mono 16-bit WAV)"
        print(
            f"first chunk: {first}\ntotal: {total:.3f} s for {audio:.2f} s of audio in {self.chunks} chunks\n"
            f"real-time factor: {rtf} (wall time / audio time)\nwrote {where}",
            file=self.stream, flush=True,
        )  # fmt: skip
