"""The speech endpoint's rates and telephony formats through a real server: the tts model's audio, resampled
whole, is what ``sample_rate`` streams, and ``pcm_mulaw`` is it at 8 kHz in G.711 codes."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import soxr

from client import TTSClient
from gateway.rates import QUALITY
from tests.unit.test_g711 import mulaw_decode

pytestmark = pytest.mark.integration
EXTRAS = {"seed": 7, "max_patches": 8, "chunk_first": 1, "chunk_next": 2}  # 4 chunks, 8 patches


@pytest.fixture(scope="module")
def reference(server):
    audio = TTSClient(f"127.0.0.1:{server.ports.grpc}").synthesize(
        "Through the gateway", seed=7, parameters={k: v for k, v in EXTRAS.items() if k != "seed"}
    )
    return np.clip(audio, -1, 1)


def speech(gateway, **body):
    return httpx.post(f"{gateway}/v1/audio/speech", timeout=60,
                      json={"input": "Through the gateway", **EXTRAS, **body})  # fmt: skip


def test_pcm_at_16_khz_is_the_tts_audio_resampled_whole(gateway, reference):
    r = speech(gateway, response_format="pcm", sample_rate=16000)
    assert r.status_code == 200, r.text
    expected = np.round(np.clip(soxr.resample(reference, 24000, 16000, quality=QUALITY), -1, 1) * 32767)
    got = np.frombuffer(r.content, "<i2")
    assert got.size == round(reference.size * 2 / 3) == expected.size
    assert np.max(np.abs(got - expected)) <= 1  # one 16-bit step: the float tolerance of two resamplings


def test_pcm_mulaw_is_8_khz_g711(gateway, reference):
    r = speech(gateway, response_format="pcm_mulaw")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/PCMU;rate=8000"
    resampled = soxr.resample(reference, 24000, 8000, quality=QUALITY)
    decoded = mulaw_decode(np.frombuffer(r.content, np.uint8)) / 32767
    assert decoded.size == resampled.size
    assert np.sqrt(np.mean((decoded - resampled) ** 2)) < 0.02 * np.sqrt(np.mean(resampled**2))
