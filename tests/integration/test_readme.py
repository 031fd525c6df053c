"""The README's first screen, run as a reader would: the addresses it says the launcher prints, its curl
command, the web page's address and its Python client snippet, taken from README.md (and the OpenAI SDK
snippet from docs/openai.md) and run against one real launcher (``python -m serving.serve`` on the tiny
checkpoint that ``make serve`` uses), with only the ports changed to the launcher's free ones. The text-in
and Instruct snippets run here too: the tiny checkpoint's stop head ends their sentences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine.protocol import SAMPLE_RATE
from tests.docs import DOCS, README, ROOT, snippet
from tests.integration.launcher import Launcher

pytestmark = pytest.mark.integration

TEXT = "Hello from FireRedTTS3."  # what every snippet says
# test_instruct_server's SHORT: the recording the README's Instruct tasks start from
INSTRUCT_SHORT = {"max_patches": 6, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}


@pytest.fixture(scope="module")
def launcher(tiny_ckpt, tmp_path_factory):
    with Launcher.start(tiny_ckpt, tmp_path_factory.mktemp("readme"), "--slots", "2") as ln:
        ln.wait_ready()
        yield ln


def with_port(code: str, default: int, port: int) -> str:
    """The snippet with its default port replaced by the launcher's (the snippet must use the default)."""
    assert f"127.0.0.1:{default}" in code, f"the snippet does not use the default port {default}:\n{code}"
    return code.replace(f"127.0.0.1:{default}", f"127.0.0.1:{port}")


def run(cmd: list[str], cwd) -> None:
    done = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{cmd[:2]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def speech(path) -> np.ndarray:
    """A WAV the snippet wrote -> its 16-bit samples; it must be 24 kHz mono and not empty."""
    audio, rate = sf.read(path, dtype="int16")
    assert rate == SAMPLE_RATE and audio.ndim == 1 and audio.size > SAMPLE_RATE // 10, (rate, audio.shape)
    return audio


@pytest.fixture(scope="module")
def curl_wav(launcher, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("curl")
    run(["bash", "-c", with_port(snippet("curl"), 8080, launcher.openai)], cwd)
    return speech(cwd / "hello.wav")


def test_the_curl_snippet_writes_speech(curl_wav):
    assert np.abs(curl_wav).max() > 0


def test_the_python_client_snippet_writes_the_same_speech_over_grpc(launcher, curl_wav, tmp_path):
    """The gateway (curl) and gRPC (the client) are two entry points: same text, seed and voice, same audio."""
    run([sys.executable, "-c", with_port(snippet("python-client"), 8001, launcher.ports.grpc)], tmp_path)
    grpc_wav = speech(tmp_path / "hello.wav")
    assert grpc_wav.size == curl_wav.size
    assert np.abs(grpc_wav.astype(np.int32) - curl_wav).max() <= 1  # each rounds to 16 bits on its own


def test_the_web_page_is_where_the_launcher_says(launcher):
    printed = launcher.text().splitlines()
    for line in with_port(snippet("addresses"), 8080, launcher.openai).splitlines():
        assert line in printed, f"the launcher did not print {line!r}"
    url = with_port(snippet("page").strip(), 8080, launcher.openai)
    assert f"web page: {url}" in printed
    page = httpx.get(url, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>FireRedTTS3</title>" in page.text and "/v1/audio/speech" in page.text


def test_the_openai_sdk_snippet_writes_mp3(launcher, curl_wav, tmp_path):
    import av

    run([sys.executable, "-c", with_port(snippet("openai-sdk", DOCS / "openai.md"), 8080, launcher.openai)], tmp_path)
    with av.open(str(tmp_path / "hello.mp3")) as f:
        assert f.format.name == "mp3"
        seconds = sum(frame.samples / frame.sample_rate for frame in f.decode(audio=0))
    assert abs(seconds - curl_wav.size / SAMPLE_RATE) < 0.1  # MP3 adds priming and padding


@pytest.mark.parametrize("name, page", [("text-in-grpc", DOCS / "serving.md"), ("text-in-client", README)])
def test_the_documented_snippets_run(name, page, launcher, tmp_path):
    """The text-in snippets (README, docs/serving.md) against the launcher: the tiny checkpoint's stop head
    ends each sentence, where the nostop one of test_text_in_server ran each to 400 patches."""
    url = f"127.0.0.1:{launcher.ports.grpc}"
    code = snippet(name, page)
    assert "127.0.0.1:8001" in code
    code = code.replace("127.0.0.1:8001", url)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if name == "text-in-client":
        assert (tmp_path / "streamed.wav").stat().st_size > 44
    else:
        assert int(done.stdout.split()[0]) > 0


def test_the_readme_instruct_snippets_write_speech(launcher, tmp_path):
    """README's "Two models" snippets as written but for the ports: design with curl, the client and the
    OpenAI SDK, and the client's other three tasks on the designed recording. (The launcher's tiny
    checkpoint holds the Instruct model, and its stop head fires: the nostop session server of
    test_instruct_server ran each design to 400 patches.)"""
    grpc = f"127.0.0.1:{launcher.ports.grpc}"
    gateway_port = f"127.0.0.1:{launcher.openai}"
    commands = {
        "designed.wav": ["bash", "-c", snippet("design-curl").replace("127.0.0.1:8080", gateway_port)],
        "designed-sdk.wav": [sys.executable, "-c", snippet("design-sdk").replace("127.0.0.1:8080", gateway_port)],
    }
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's client
    for out, command in commands.items():
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        audio, rate = sf.read(tmp_path / out)
        assert rate == 24000 and audio.size, out
    python = snippet("design-client").replace("127.0.0.1:8001", grpc)
    done = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # a recording of a usable length for the other tasks, whatever the designs' length was
    sf.write(tmp_path / "designed.wav", launcher.client(timeout=120).synthesize(
        "Good evening.", instruction="a calm older man", parameters=INSTRUCT_SHORT), 24000)  # fmt: skip
    tasks = snippet("tasks-client").replace("127.0.0.1:8001", grpc)
    done = subprocess.run([sys.executable, "-c", tasks], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for out in ("cloned.wav", "reworded.wav", "faster.wav"):
        audio, rate = sf.read(tmp_path / out)
        assert rate == 24000 and audio.size, out
