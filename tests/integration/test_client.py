"""The client package against a real server: protocols agree, asyncio streams, the CLI end to end."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import wave

import numpy as np
import pytest

from client import AsyncTTSClient, TTSClient
from client.audio_io import pcm16, write_wav
from serving.supervision.triton_env import REPO_ROOT

pytestmark = pytest.mark.integration

# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
PARAMS = {"max_patches": 7, "chunk_first": 2, "chunk_next": 3, "chunk_fixed": True}


def cli(server, *args, stdin: str | None = None, protocol: str = "grpc") -> subprocess.CompletedProcess:
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    cmd = [
        sys.executable,
        "-m",
        "client",
        "--url",
        f"127.0.0.1:{port}",
        "--protocol",
        protocol,
        "--timeout",
        "30",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    data = stdin.encode() if stdin is not None else None
    return subprocess.run(cmd, check=False, input=data, capture_output=True, timeout=60, cwd=REPO_ROOT, env=env)


@pytest.fixture(scope="module")
def reference(server) -> np.ndarray:
    """The gRPC stream's audio for "Same audio" with seed 21."""
    chunks = list(
        TTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=30).stream("Same audio", seed=21, parameters=PARAMS)
    )
    assert len(chunks) >= 3 and all(b.arrival >= a.arrival for a, b in itertools.pairwise(chunks))
    return np.concatenate([c.audio for c in chunks])


def test_http_gives_the_same_audio(server, reference):
    got = TTSClient(f"http://127.0.0.1:{server.ports.http}", "http", timeout=30).synthesize(
        "Same audio", seed=21, parameters=PARAMS
    )
    assert got.shape == reference.shape == (7 * 3840,)
    np.testing.assert_allclose(got, reference, atol=1e-6)  # JSON carries float32 as decimals


def test_asyncio_streams_share_a_channel(server, reference):
    async def go():
        async with AsyncTTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=30) as tts:
            chunks = [c async for c in tts.stream("Same audio", seed=21, parameters=PARAMS)]
            several = await asyncio.gather(*(tts.synthesize(f"Voice {i}", seed=i, parameters={"max_patches": 6 + i})
                                             for i in range(3)))  # fmt: skip
            return chunks, several

    chunks, several = asyncio.run(go())
    assert len(chunks) >= 3 and chunks[0].arrival <= chunks[-1].arrival
    np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]), reference)
    assert [a.shape for a in several] == [((6 + i) * 3840,) for i in range(3)]


def test_cli_writes_a_24khz_wav(server, reference, tmp_path):
    out = tmp_path / "out.wav"
    r = cli(server, "--text", "Same audio", "--seed", "21", "--max-patches", "7", "--chunk-first", "2",
            "--chunk-next", "3", "--chunk-fixed", "--out", str(out))  # PARAMS: bit for bit  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 7 * 3840)
        assert w.readframes(w.getnframes()) == pcm16(reference)
    err = r.stderr.decode()
    assert "first chunk:" in err and "real-time factor:" in err and "1.12 s of audio" in err


def test_cli_text_from_stdin_pcm_to_stdout_over_http(server, reference):
    r = cli(
        server, "--text", "-", "--seed", "21", "--max-patches", "7", "--out", "-", stdin="Same audio\n", protocol="http"
    )
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout) == 2 * 7 * 3840  # only audio on stdout: s16le, nothing else
    assert np.abs(np.frombuffer(r.stdout, "<i2").astype(int) - np.frombuffer(pcm16(reference), "<i2")).max() <= 1


def test_cli_reference_voice(server, tmp_path):
    ref = (0.1 * np.random.default_rng(3).standard_normal(20000)).astype(np.float32)
    write_wav(tmp_path / "ref.wav", ref, 16000)
    r = cli(server, "--text", "Cloned", "--ref-audio", str(tmp_path / "ref.wav"), "--ref-text", "a reference",
            "--max-patches", "6", "--out", str(tmp_path / "o.wav"))  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    with wave.open(str(tmp_path / "o.wav")) as w:
        assert w.getnframes() == 6 * 3840


def test_cli_invalid_request_exits_nonzero_with_the_server_message(server, tmp_path):
    out = tmp_path / "bad.wav"
    r = cli(server, "--text", "Hello", "--language", "Klingon", "--out", str(out))
    assert r.returncode == 1
    assert "unknown language 'Klingon'" in r.stderr.decode()
    assert not out.exists()
