"""Output rates and telephony formats of the speech endpoint (gateway/rates.py, gateway/encode.py): audio
streamed in the server's chunks is the whole audio resampled at once, the right length, the right sine; the
raw formats carry it at the asked rate; a bad rate or format is a 400 naming ``sample_rate``."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import soxr
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.encode import Encoder
from gateway.rates import QUALITY, RATES, StreamResampler, check_rate
from serving.supervision.triton_env import free_port
from tests.unit.test_g711 import alaw_decode, mulaw_decode

PATCH = 3840  # samples of one patch at 24 kHz
CHUNKS = [3 * PATCH, 12 * PATCH, 1, 7, 12 * PATCH, 2 * PATCH + 5]  # the schedule's sizes, and odd ones
UNREACHABLE = 503  # a request that passed every check, sent to a closed port


def speech_audio(seconds: float = 4.0) -> np.ndarray:
    """Noise-like float32 audio at 24 kHz: every frequency up to Nyquist, as the tiny checkpoint makes."""
    rng = np.random.default_rng(0)
    return (0.3 * rng.standard_normal(int(seconds * 24000))).astype(np.float32)


def chunked(audio: np.ndarray, sizes=CHUNKS) -> list[np.ndarray]:
    edges = np.cumsum([0, *sizes])
    parts = [audio[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [*parts, audio[edges[-1] :]]


@pytest.mark.parametrize("rate", [r for r in RATES if r != 24000])
def test_streamed_is_the_whole_resampled_at_once(rate):
    audio = speech_audio()
    resampler = StreamResampler(rate)
    streamed = np.concatenate([resampler.push(c) for c in chunked(audio)] + [resampler.finish()])
    whole = soxr.resample(audio, 24000, rate, quality=QUALITY)
    assert streamed.size == round(audio.size * rate / 24000) == whole.size
    np.testing.assert_allclose(streamed, whole, atol=1e-6)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_a_sine_comes_out_as_the_same_sine(rate):
    """Independent of libsoxr: a 440 Hz tone at 24 kHz, resampled, is the tone sampled at the new rate (the
    filter's delay is compensated; the first and last 10 ms are the filter's edges)."""
    t_in = np.arange(48000) / 24000
    resampler = StreamResampler(rate)
    tone = np.sin(2 * np.pi * 440 * t_in).astype(np.float32)
    out = np.concatenate([resampler.push(c) for c in chunked(tone)] + [resampler.finish()])
    expected = np.sin(2 * np.pi * 440 * np.arange(out.size) / rate)
    middle = slice(rate // 100, out.size - rate // 100)
    np.testing.assert_allclose(out[middle], expected[middle], atol=2e-3)


def test_24_khz_passes_through_and_a_finished_stream_takes_no_more():
    audio = speech_audio(0.5)
    resampler = StreamResampler(24000)
    assert np.array_equal(resampler.push(audio), audio) and resampler.finish().size == 0
    with pytest.raises(RuntimeError, match="finished"):
        resampler.push(audio)


def encoded(fmt: str, rate: int | None, audio: np.ndarray) -> tuple[str, bytes]:
    encoder = Encoder(fmt, rate)
    data = b"".join(encoder.push(c) for c in chunked(audio)) + encoder.finish()
    return encoder.media_type, data


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100])
def test_pcm_and_wav_at_a_rate(rate):
    audio = speech_audio(1.0)
    expected = np.round(np.clip(soxr.resample(audio, 24000, rate, quality=QUALITY), -1, 1) * 32767)
    _, pcm = encoded("pcm", rate, audio)
    assert np.array_equal(np.frombuffer(pcm, "<i2"), expected)
    media_type, wav = encoded("wav", rate, audio)
    assert media_type == "audio/wav" and wav[:4] == b"RIFF" and wav[44:] == pcm
    channels, sample_rate, byte_rate = struct.unpack("<HII", wav[22:32])
    assert (channels, sample_rate, byte_rate) == (1, rate, 2 * rate)


@pytest.mark.parametrize(("fmt", "decode", "media"), [("pcm_mulaw", mulaw_decode, "audio/PCMU"),
                                                      ("pcm_alaw", alaw_decode, "audio/PCMA")])  # fmt: skip
def test_g711_is_8_khz_by_default_and_decodes_to_the_resampled_audio(fmt, decode, media):
    audio = 0.5 * speech_audio(1.0)
    media_type, data = encoded(fmt, None, audio)
    assert media_type == f"{media};rate=8000" and len(data) == 8000  # one byte a sample
    decoded = decode(np.frombuffer(data, np.uint8)) / 32767
    resampled = soxr.resample(audio, 24000, 8000, quality=QUALITY)
    error = decoded - resampled
    assert np.sqrt(np.mean(error**2)) < 0.02 * np.sqrt(np.mean(resampled**2))  # G.711's ~38 dB
    media_type, data = encoded(fmt, 16000, audio)
    assert media_type == f"{media};rate=16000" and len(data) == 16000


def test_the_model_rate_is_unchanged_for_the_old_formats():
    audio = speech_audio(0.5)
    _, pcm = encoded("pcm", None, audio)
    assert np.array_equal(np.frombuffer(pcm, "<i2"), np.round(np.clip(audio, -1, 1) * 32767))
    assert check_rate("mp3", None) == check_rate("mp3", 24000) == 24000


@pytest.fixture(scope="module")
def gateway():
    with TestClient(create_app(f"127.0.0.1:{free_port()}", timeout=5)) as client:
        yield client


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"sample_rate": 11025}, "must be one of"),
        ({"sample_rate": "8000"}, "got '8000'"),
        ({"sample_rate": 8000.0}, "got 8000.0"),
        ({"sample_rate": True}, "got True"),
        ({"sample_rate": [8000]}, "got a list"),
        ({"sample_rate": 8000, "response_format": "mp3"}, "mp3 is always 24000 Hz"),
        ({"sample_rate": 16000, "response_format": "opus"}, "applies to response_format pcm, wav"),
    ],
)
def test_a_bad_rate_is_a_400_naming_sample_rate(gateway, fields, words):
    r = gateway.post("/v1/audio/speech", json={"input": "Hello there", "response_format": "pcm", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sample_rate" and "sample_rate" in error["message"] and words in error["message"]


def test_an_unknown_format_names_the_telephony_ones(gateway):
    r = gateway.post("/v1/audio/speech", json={"input": "Hello there", "response_format": "ulaw"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "pcm_mulaw" in r.json()["error"]["message"] and "pcm_alaw" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields",
    [{"response_format": "pcm_mulaw"}, {"response_format": "pcm_alaw", "sample_rate": 8000},
     {"response_format": "wav", "sample_rate": 44100}, {"response_format": "mp3", "sample_rate": 24000},
     {"response_format": "pcm", "sample_rate": None}],
)  # fmt: skip
def test_good_rates_pass_every_check(gateway, fields):
    r = gateway.post("/v1/audio/speech", json={"input": "Hello there", **fields})
    assert r.status_code == UNREACHABLE, r.text


def test_the_get_form_takes_sample_rate_as_a_number(gateway):
    ok = gateway.get("/v1/audio/speech?input=Hi&response_format=pcm_mulaw&sample_rate=16000")
    assert ok.status_code == UNREACHABLE, ok.text
    bad = gateway.get("/v1/audio/speech?input=Hi&response_format=pcm&sample_rate=eight")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sample_rate"
