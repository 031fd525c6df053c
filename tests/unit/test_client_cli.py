"""The CLI without a server: argument handling, subcommand dispatch, output files and exit codes."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from client import Chunk, TTSError
from client.audio_io import pcm16
from client.cli import Command, build_parser, main, synthesize


class FakeClient:
    """Streams the given chunks (after the plan text, if one is given), then raises ``error`` if one is given."""

    def __init__(self, chunks, error=None, plan=None):
        self.chunks, self.error, self.plan, self.calls = chunks, error, plan, []

    def stream(self, text, on_plan=None, **kw):
        self.calls.append((text, kw))
        if self.plan is not None:
            on_plan(self.plan)
        for i, a in enumerate(self.chunks):
            yield Chunk(a, 0.1 * (i + 1))
        if self.error:
            raise self.error


CHUNKS = [np.full(2400, 0.25, np.float32), np.full(4800, -0.5, np.float32)]


def test_synthesize_writes_wav_and_summary(tmp_path, capsys):
    out = tmp_path / "a.wav"
    assert synthesize(FakeClient(CHUNKS), "Hi", {}, str(out)) == 0
    with wave.open(str(out)) as r:
        assert (r.getframerate(), r.getnchannels(), r.getsampwidth()) == (24000, 1, 2)
        assert r.readframes(r.getnframes()) == pcm16(np.concatenate(CHUNKS))
    err = capsys.readouterr().err
    assert "chunk 2: 0.30 s of audio" in err
    assert "first chunk: 0.100 s" in err and "real-time factor" in err


def test_synthesize_pcm_to_stdout(monkeypatch, capsys):
    buf = io.BytesIO()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(buf))
    assert synthesize(FakeClient(CHUNKS), "Hi", {}, "-", quiet=True) == 0
    assert buf.getvalue() == pcm16(np.concatenate(CHUNKS))
    assert capsys.readouterr().err == ""


def test_server_error_exits_1_with_its_message_and_no_file(tmp_path, capsys):
    out = tmp_path / "a.wav"
    client = FakeClient(CHUNKS[:1], TTSError("LANGUAGE: unknown language 'Klingon'"))
    assert synthesize(client, "Hi", {}, str(out)) == 1
    assert "error: LANGUAGE: unknown language 'Klingon'" in capsys.readouterr().err
    assert not out.exists()


def test_request_options_reach_the_client(tmp_path, monkeypatch):
    seen = {}

    def fake_synthesize(client, text, request, out, quiet=False, lines=None):
        seen.update(url=(client.host, client.port, client.protocol), text=text, request=request, out=out)
        return 0

    monkeypatch.setattr("client.cli.synthesize", fake_synthesize)
    monkeypatch.setattr("sys.stdin", io.StringIO("  from stdin \n"))
    argv = ["--url", "h:9", "--protocol", "http", "--text", "-", "--language", "German", "--voice-id", "v1",
            "--seed", "5", "--max-patches", "12", "--cfg", "1.5", "--speed", "1.25", "--no-normalize", "--out",
            "o.wav"]  # fmt: skip
    assert main(argv) == 0
    assert seen["url"] == ("h", 9, "http") and seen["text"] == "from stdin" and seen["out"] == "o.wav"
    parameters = {"max_patches": 12, "cfg": 1.5, "normalize": False, "speed": 1.25}
    assert seen["request"] == {"language": "German", "voice_id": "v1", "ref_text": None, "seed": 5,
                               "instruction": None, "task": None, "parameters": parameters}  # fmt: skip
    assert main(argv[:-3] + ["--out", "o.wav"]) == 0  # no flag: the server's default, not sent
    assert "normalize" not in seen["request"]["parameters"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--text", "Hi"], "--text and --out"),
        (["--out", "a.wav"], "--text and --out"),
        (["--text", "Hi", "--out", "a.wav", "--ref-text", "t"], "--ref-text needs --ref-audio"),
        (["--text", "Hi", "--out", "a.wav", "--voice-id", "v", "--ref-audio", "r.wav"], "not allowed with"),
        (["--text", "Hi", "--out", "a.wav", "--ref-audio", "/nonexistent.wav"], "cannot read --ref-audio"),
    ],
)
def test_usage_errors_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


class FakeTextClient(FakeClient):
    """Records the pieces a text-in stream sends, read as the audio streams."""

    def stream_text(self, pieces, flush=False, on_plan=None, **kw):
        self.calls.append((list(pieces), flush, kw))
        return self.stream(None, on_plan)


def test_lines_of_stdin_are_a_text_in_stream_each_line_flushed(tmp_path, monkeypatch):
    fake = FakeTextClient(CHUNKS)
    monkeypatch.setattr("client.cli.TTSClient", lambda *a, **kw: fake)
    monkeypatch.setattr("sys.stdin", io.StringIO("First line.\nSecond line\n"))
    out = tmp_path / "lines.wav"
    assert main(["--text", "-", "--lines", "--seed", "3", "--out", str(out), "-q"]) == 0
    pieces, flush, kw = fake.calls[0]
    assert pieces == ["First line.\n", "Second line\n"] and flush and kw["seed"] == 3
    with wave.open(str(out)) as r:
        assert r.getnframes() == sum(c.size for c in CHUNKS)


@pytest.mark.parametrize("argv", [["--text", "Hi", "--lines"], ["--text", "-", "--lines", "--protocol", "http"],
                                  ["--text", "-", "--lines", "--model", "tts_ensemble"]])  # fmt: skip
def test_lines_need_stdin_grpc_and_tts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", "a.wav"])
    assert e.value.code == 2 and "--lines streams stdin" in capsys.readouterr().err


def test_subcommands_plug_in_and_synthesize_stays_the_default(monkeypatch):
    """The shape a `voices` group will take: `python -m client --url U voices add NAME --audio A --text T`."""
    ran = []

    def add_arguments(p):
        sub = p.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add")
        add.add_argument("name")
        add.add_argument("--audio")
        add.add_argument("--text", dest="voice_text")
        sub.add_parser("list")

    voices = Command("manage voices", add_arguments, lambda args: ran.append(args) or 0)
    commands = {"voices": voices}
    assert main(["--url", "h:1", "voices", "add", "n1", "--audio", "a.wav", "--text", "t"], commands) == 0
    assert (ran[0].url, ran[0].action, ran[0].name, ran[0].voice_text) == ("h:1", "add", "n1", "t")
    assert main(["--url", "h:1", "voices", "list"], commands) == 0 and ran[1].action == "list"
    monkeypatch.setattr("client.cli.synthesize", lambda *a, **k: 7)
    assert main(["--url", "h:1", "--text", "Hi", "--out", "a.wav"], commands) == 7
    assert build_parser({}).parse_args(["--text", "x", "--out", "y"]).command is None


def run_main(monkeypatch, argv):
    """main(argv) with synthesize replaced: (exit status, what synthesize was given)."""
    seen = {}

    def fake_synthesize(client, text, request, out, quiet=False, lines=None):
        seen.update(text=text, request=request, out=out, model=client.model)
        return 0

    monkeypatch.setattr("client.cli.synthesize", fake_synthesize)
    return main(argv), seen


def write_recording(path, seconds=0.5, rate=16000):
    import soundfile

    soundfile.write(path, np.full(int(seconds * rate), 0.25, np.float32), rate, subtype="PCM_16")
    return str(path)


def test_an_instruction_designs_a_voice(monkeypatch):
    status, seen = run_main(monkeypatch, ["--text", "Hi", "--instruction", "a calm older man", "--out", "o.wav"])
    assert status == 0 and seen["text"] == "Hi"
    assert seen["request"]["instruction"] == "a calm older man" and seen["request"]["voice_id"] is None
    assert "ref_audio" not in seen["request"]


def test_an_edit_sends_the_recording_and_no_text(monkeypatch, tmp_path):
    recording = write_recording(tmp_path / "in.wav")
    argv = [
        "--edit",
        "acoustic",
        "--recording",
        recording,
        "--instruction",
        "adjust the speed to 0.8x",
        "--out",
        "o.wav",
    ]
    status, seen = run_main(monkeypatch, argv)
    request = seen["request"]
    assert status == 0 and seen["text"] is None
    assert (request["task"], request["instruction"], request["ref_sample_rate"]) == (
        "acoustic_edit", "adjust the speed to 0.8x", 16000)  # fmt: skip
    assert request["ref_audio"].shape == (8000,) and abs(float(request["ref_audio"][0]) - 0.25) < 1e-4
    _, seen = run_main(monkeypatch, ["--edit", "semantic", "--recording", recording, "--instruction", "Delete 'a'.",
                                     "--out", "o.wav"])  # fmt: skip
    assert seen["request"]["task"] == "semantic_edit"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--text", "Hi", "--out", "a.wav", "--instruction", "calm", "--voice-id", "v"], "cannot go with --ref-audio"),
        (["--text", "Hi", "--out", "a.wav", "--instruction", "calm", "--voice-id", "v"], "Drop --instruction"),
        (["--text", "Hi", "--out", "a.wav", "--task", "clone"], "--task clone needs --ref-audio or --voice-id"),
        (["--text", "Hi", "--out", "a.wav", "--task", "design"], "--task design needs --instruction"),
        (["--text", "Hi", "--out", "a.wav", "--recording", "r.wav"], "--recording goes with --edit"),
        (["--edit", "semantic", "--instruction", "x", "--out", "a.wav"], "--edit needs --recording"),
        (["--edit", "semantic", "--recording", "r.wav", "--out", "a.wav"], "--edit needs --recording, --instruction"),
        (["--edit", "semantic", "--recording", "r.wav", "--instruction", "x", "--out", "a.wav", "--text", "Hi"],
         "drop --text"),
        (["--edit", "semantic", "--recording", "r.wav", "--instruction", "x", "--out", "a.wav", "--voice-id", "v"],
         "drop --voice-id"),
        (["--edit", "semantic", "--recording", "/nonexistent.wav", "--instruction", "x", "--out", "a.wav"],
         "cannot read --recording"),
        (["--edit", "loud", "--recording", "r.wav", "--instruction", "x", "--out", "a.wav"], "invalid choice"),
        (["--text", "Hi", "--out", "a.wav", "--instruction", "calm", "--model", "tts_ensemble"], "need --model tts"),
    ],
)  # fmt: skip
def test_instruct_usage_errors_exit_2_before_anything_is_sent(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr("client.cli.synthesize", lambda *a, **k: pytest.fail("sent"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_the_plan_text_goes_to_stderr_and_the_audio_to_the_file(tmp_path, capsys, quiet):
    out = tmp_path / "o.wav"
    client = FakeClient(CHUNKS, plan="年轻女性，语速稍慢")
    assert synthesize(client, "Hi", {"instruction": "gentle"}, str(out), quiet=quiet) == 0
    assert "plan text: 年轻女性，语速稍慢" in capsys.readouterr().err
    with wave.open(str(out)) as w:
        assert w.getnframes() == sum(a.size for a in CHUNKS)
