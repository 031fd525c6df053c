"""``python -m client``: speak text through the server into a WAV file, or as raw PCM to stdout.

    python -m client --url 127.0.0.1:8001 --text "Hello" --out hello.wav
    echo "Hello" | python -m client --text - --out - | aplay -f S16_LE -r 24000 -c 1
    python -m client --text "Hello" --instruction "a calm older man, slightly hoarse" --out designed.wav
    python -m client --edit semantic --recording in.wav --instruction "Replace 'cats' with 'dogs'." --out e.wav
    python -m client --text-file chapter.txt --seed 7 --out chapter.wav   # long text: parts in order, joined

Progress and the summary (first-chunk latency, total time, real-time factor) go to stderr, and so does
the plan text of FireRedTTS3-Instruct (a designed voice's attributes, a semantic edit's new transcript);
stdout carries only audio. A failed request exits with status 1 and the server's message on stderr.

Subcommands (``python -m client --url U NAME ...``) come from :data:`COMMANDS`; with none given the
CLI synthesizes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from client.audio_io import WavWriter, read_audio, write_pcm
from client.longform import DEFAULT_PART_CHARS, JOIN_SILENCE_SECONDS, silence, speak_long, split_text
from client.request import EDIT_KINDS, TTSError, edit_task
from client.tts_client import TTSClient
from engine.params import DEFAULT_SEED
from engine.protocol import SAMPLE_RATE
from serving.contract import CLONE, DESIGN, MAX_TEXT_CHARS, SPEAK, TASK_DEFAULTS, TTS_PARAMETERS


@dataclass(frozen=True)
class Command:
    """A subcommand of the CLI."""

    help: str  # one line for ``--help``
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its own options (may add nested subparsers)
    run: Callable[[argparse.Namespace], int]  # gets the whole namespace (--url, --protocol, --timeout too)


COMMANDS: dict[str, Command] = {}  # name -> subcommand
_DESIGN_SEED = TASK_DEFAULTS[DESIGN].seed


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
    text = syn.add_mutually_exclusive_group()
    text.add_argument("--text", help="text to speak; '-' reads it from stdin")
    text.add_argument("--text-file", help="a long text (a chapter) to speak part by part, in order, joined "
                      "(client/longform.py's rule: parts of at most --part-chars, cut at paragraphs, then "
                      f"sentences; {JOIN_SILENCE_SECONDS:g} s of silence between two); '-' reads stdin")  # fmt: skip
    syn.add_argument("--part-chars", type=int, default=DEFAULT_PART_CHARS,
                     help=f"with --text-file: characters of a part, one request (default {DEFAULT_PART_CHARS}, "
                          f"at most {MAX_TEXT_CHARS})")  # fmt: skip
    syn.add_argument("--lines", action="store_true",
                     help="with --text -: a text-in stream (gRPC, --model tts): each line of stdin is sent as it is "
                          "read and spoken at once, while later lines are still coming")  # fmt: skip
    syn.add_argument("--language", help="language or dialect name (server default: detected from the text)")
    voice = syn.add_mutually_exclusive_group()
    voice.add_argument("--voice-id", help="a voice registered on the server")
    voice.add_argument("--ref-audio", help="reference voice recording (any format libsndfile reads)")
    syn.add_argument("--ref-text", help="transcript of --ref-audio")
    syn.add_argument("--seed", type=int, help=f"sampling seed (server default: {DEFAULT_SEED}, {_DESIGN_SEED} for a "
                     "designed voice)")  # fmt: skip
    syn.add_argument(
        "--instruction",
        help="FireRedTTS3-Instruct: a voice description to design a voice from (with --text and no voice), or "
        "with --edit what to change",
    )  # fmt: skip
    syn.add_argument("--task", choices=[SPEAK, CLONE, DESIGN],
                     help=f"{SPEAK}: Base (the default; with --instruction: {DESIGN}); {CLONE}: Instruct cloning of "
                          "--ref-audio or --voice-id")  # fmt: skip
    syn.add_argument("--edit", choices=list(EDIT_KINDS),
                     help="edit --recording as --instruction says: semantic (its words) or acoustic (speed, pitch, "
                          "volume: one of the model's templates)")  # fmt: skip
    syn.add_argument("--recording", help="with --edit: the recording to edit (at most 30 s)")
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
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    if args.model != "tts" and (args.instruction, args.task, args.edit) != (None, None, None):
        ap.error("--instruction, --task and --edit need --model tts (FireRedTTS3-Instruct is not in tts_ensemble)")
    if args.lines and (args.text != "-" or args.protocol != "grpc" or args.model != "tts" or args.edit):
        ap.error("--lines streams stdin (--text -) to --model tts over gRPC, and speaks no --edit")
    if args.text_file is not None:
        if args.lines or args.edit:
            ap.error("--text-file speaks a file part by part: no --lines, no --edit")
        text, request = _long_request(ap, args)
    elif args.edit is not None:
        text, request = None, _edit_request(ap, args)
    else:
        text, request = _speak_request(ap, args)
    request["parameters"] = {p.name: getattr(args, p.name) for p in TTS_PARAMETERS if getattr(args, p.name) is not None}
    client = TTSClient(args.url or "127.0.0.1", args.protocol, timeout=args.timeout, model=args.model)
    if args.text_file is not None:
        return synthesize_long(client, text, request, args.out, args.part_chars, quiet=args.quiet)
    return synthesize(client, text, request, args.out, quiet=args.quiet, lines=sys.stdin if args.lines else None)


def _speak_request(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, dict]:
    if args.text is None or args.out is None:
        ap.error("synthesizing needs --text and --out")
    if args.ref_text is not None and args.ref_audio is None:
        ap.error("--ref-text needs --ref-audio")
    if args.recording is not None:
        ap.error("--recording goes with --edit")
    has_voice = args.ref_audio is not None or args.voice_id is not None
    if args.instruction is not None and has_voice:
        ap.error("--instruction designs a new voice and cannot go with --ref-audio or --voice-id: "
                 "FireRedTTS3-Instruct's cloning takes no instruction. Drop --instruction to clone the voice, or "
                 f"drop the voice to design one from the instruction (--task {CLONE}: Instruct cloning)")  # fmt: skip
    if args.task == CLONE and not has_voice:
        ap.error(f"--task {CLONE} needs --ref-audio or --voice-id")
    if args.task == DESIGN and args.instruction is None:
        ap.error(f"--task {DESIGN} needs --instruction")
    text = None if args.lines else sys.stdin.read().strip() if args.text == "-" else args.text
    request = {"language": args.language, "voice_id": args.voice_id, "ref_text": args.ref_text, "seed": args.seed,
               "instruction": args.instruction, "task": args.task}  # fmt: skip
    if args.ref_audio is not None:
        request["ref_audio"], request["ref_sample_rate"] = _read(ap, "--ref-audio", args.ref_audio)
    return text, request


def _long_request(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, dict]:
    """--text-file's text (checked against the split rule before anything is sent) and request."""
    if args.out is None:
        ap.error("--text-file needs --out")
    try:
        text = sys.stdin.read() if args.text_file == "-" else open(args.text_file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"cannot read --text-file {args.text_file}: {e}")
    try:
        split_text(text, args.part_chars)
    except ValueError as e:
        ap.error(f"--text-file: {e}")
    args.text = text  # the rest of the request as --text's
    _, request = _speak_request(ap, args)
    return text, request


def synthesize_long(client: TTSClient, text: str, request: dict, out: str, part_chars: int,
                    quiet: bool = False) -> int:  # fmt: skip
    """``text`` spoken part by part (:func:`client.longform.speak_long`) into ``out`` ('-': stdout as s16le),
    with a progress line (parts, audio seconds, ETA) on stderr; returns the exit status."""
    try:
        sink = _PcmSink(sys.stdout.buffer) if out == "-" else WavWriter(out)
    except OSError as e:
        print(f"error: cannot write {out}: {e}", file=sys.stderr)
        return 1
    progress = _PartProgress(sys.stderr, len("".join(split_text(text, part_chars))), enabled=not quiet)

    def write() -> None:
        for part in speak_long(client, text, part_chars, **request, on_plan=progress.plan):
            if part.index:
                sink.write(silence())
            sink.write(part.audio)
            progress.part(part)

    if (failed := _written(sink, out, progress, write)) is not None:
        return failed
    progress.end()
    if not quiet:
        where = "stdout (s16le, 24 kHz mono)" if out == "-" else f"{out} (24 kHz mono 16-bit WAV)"
        print(f"wrote {where}", file=sys.stderr, flush=True)
    return 0


def _edit_request(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    if args.recording is None or args.instruction is None or args.out is None:
        ap.error("--edit needs --recording, --instruction and --out")
    given = {"--text": args.text, "--ref-audio": args.ref_audio, "--voice-id": args.voice_id,
             "--ref-text": args.ref_text, "--task": args.task, "--language": args.language}  # fmt: skip
    extra = [flag for flag, value in given.items() if value is not None]
    if extra:
        ap.error(f"--edit takes what to change from --instruction and the voice and words from --recording: drop "
                 f"{extra[0]}")  # fmt: skip
    audio, rate = _read(ap, "--recording", args.recording)
    return {"ref_audio": audio, "ref_sample_rate": rate, "instruction": args.instruction,
            "task": edit_task(args.edit), "seed": args.seed}  # fmt: skip


def _read(ap: argparse.ArgumentParser, flag: str, path: str):
    try:
        return read_audio(path)
    except Exception as e:  # libsndfile's errors are not OSError; any of them means: unreadable
        ap.error(f"cannot read {flag} {path}: {e}")


def synthesize(client: TTSClient, text: str | None, request: dict, out: str, quiet: bool = False,
               lines: Iterable[str] | None = None) -> int:  # fmt: skip
    """Stream into ``out`` ('-': stdout as s16le); returns the exit status. ``lines``: the text, as a text-in
    stream whose every line is flushed (``text`` is then not read)."""
    try:
        sink = _PcmSink(sys.stdout.buffer) if out == "-" else WavWriter(out)
    except OSError as e:
        print(f"error: cannot write {out}: {e}", file=sys.stderr)
        return 1
    progress = _Progress(sys.stderr, enabled=not quiet)

    def write() -> None:
        # the plan text arrives before the first chunk, so it is printed above the progress line
        chunks = (client.stream(text, **request, on_plan=progress.plan) if lines is None
                  else client.stream_text(lines, flush=True, **request, on_plan=progress.plan))  # fmt: skip
        with contextlib.closing(chunks):  # closing early cancels the request
            for chunk in chunks:
                sink.write(chunk.audio)
                progress.chunk(chunk)

    if (failed := _written(sink, out, progress, write)) is not None:
        return failed
    progress.summary(out)
    return 0


def _written(sink, out: str, progress, write: Callable[[], None]) -> int | None:
    """Run ``write`` into ``sink`` and close it: None, or on a failure the exit status (the error on stderr,
    a partial ``out`` removed)."""
    try:
        write()
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
    return None


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


class _PartProgress:
    """Parts done of all, audio seconds so far and an ETA (from the pace in characters) on one line."""

    def __init__(self, stream, chars: int, enabled: bool = True):
        self.stream, self.chars, self.enabled = stream, chars, enabled
        self.tty = enabled and stream.isatty()
        self.t0, self.done, self.seconds, self.planned = time.perf_counter(), 0, 0.0, False

    def part(self, part) -> None:
        self.done += len(part.text)
        self.seconds += part.audio.size / SAMPLE_RATE + (JOIN_SILENCE_SECONDS if part.index else 0.0)
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        eta = (self.chars - self.done) * elapsed / self.done if self.done else 0.0
        line = (f"part {part.index + 1}/{part.total}: {self.seconds:.1f} s of audio in {elapsed:.1f} s, "
                f"ETA {eta:.0f} s")  # fmt: skip
        print(f"\r{line}\033[K" if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def plan(self, text: str) -> None:
        if not self.planned:  # every part designs the same voice (same seed and instruction): said once
            self.planned = True
            print(f"plan text: {text}", file=self.stream, flush=True)

    def end(self) -> None:
        if self.tty and self.done:
            print(file=self.stream)


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

    def plan(self, text: str) -> None:
        """FireRedTTS3-Instruct's plan text, shown whatever --quiet says: it is part of the answer."""
        print(f"plan text: {text}", file=self.stream, flush=True)

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
