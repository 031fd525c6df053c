"""The HTTP dialects' tables and timings without a server (gateway/dialects/, gateway/socket_audio.py)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile
import soxr

from gateway.dialects import cartesia_http, elevenlabs_http
from gateway.encode import Encoder, wav_header
from gateway.errors import APIError
from gateway.socket_audio import char_times, word_times
from tests.fixtures.vendor_http import CALLS, ELEVENLABS_OUTPUT_FORMATS, TEXT, VOICE


@pytest.mark.parametrize("text", ["Hello there, how are you?", "  two  spaces ", "你好 世界", "one"])
def test_char_times_cover_every_character_and_the_whole_span(text):
    chars, starts, ends = char_times(text, 0.5, 2.5)
    assert "".join(chars) == text
    assert np.all(np.diff(starts) >= 0) and np.all(np.diff(ends) >= 0)
    assert all(s <= e for s, e in zip(starts, ends, strict=True))
    assert max(ends) == 2.5 and min(starts) == 0.5
    words, word_starts, _ = word_times(text, 0.5, 2.5)  # each word starts where the word timings say
    at = 0
    for word, start in zip(words, word_starts, strict=True):
        at = text.index(word, at)
        assert starts[at] == start
        at += len(word)


def test_every_elevenlabs_format_is_made_or_refused_by_name():
    made = set(elevenlabs_http.OUTPUT_FORMATS)
    assert made <= set(ELEVENLABS_OUTPUT_FORMATS)
    assert set(ELEVENLABS_OUTPUT_FORMATS) == made  # every format the SDK lists is made
    with pytest.raises(APIError) as refused:
        elevenlabs_http.output_format("pcm_11025")  # a rate no SDK lists
    assert refused.value.param == "output_format" and "pcm_11025" in refused.value.message


@pytest.mark.parametrize("rate", [22050, 44100])
def test_mp3_at_the_rate_a_dialect_asks(rate):
    encoder = Encoder("mp3", rate)
    data = encoder.push(np.sin(np.arange(24000) / 10).astype(np.float32) * 0.3) + encoder.finish()
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].rate == rate


def test_pcm_f32le_is_the_float_samples():
    audio = np.array([0.25, -1.5, 0.5], np.float32)
    assert np.array_equal(np.frombuffer(Encoder("pcm_f32le").push(audio), "<f4"), [0.25, -1.0, 0.5])


def test_the_clients_requests_become_the_core_request():
    fields, out, volume = cartesia_http.request_fields(CALLS["sdk-generate"].body, ("raw", "wav", "mp3"))
    assert (fields["input"], fields["voice"], out.container, out.sample_rate, volume) == (
        TEXT,
        VOICE,
        "wav",
        44100,
        None,
    )
    fields, out, _ = cartesia_http.request_fields(CALLS["pipecat-cartesia"].body, ("raw",))
    assert (fields["voice"], fields["language"], cartesia_http.encoder_format(out)) == (VOICE, "English", "pcm")


@pytest.mark.parametrize("samples", ["pcm", "pcm_f32le", "pcm_mulaw", "pcm_alaw"])
def test_a_streaming_wav_of_each_encoding_reads_back(samples):
    """libsndfile reads each header (sizes "unknown", as a stream has them) with its samples."""
    audio = (np.sin(np.arange(800) / 7) * 0.5).astype(np.float32)
    encoder = Encoder(samples, 8000)
    got, rate = soundfile.read(io.BytesIO(wav_header(8000, samples) + encoder.push(audio) + encoder.finish()))
    assert (
        rate == 8000
        and got.size == 267
        and np.abs(got[20:-20] - soxr.resample(audio, 24000, 8000)[20:-20]).max() < 0.02
    )
    fields = elevenlabs_http.request_fields(CALLS["sdk-stream"].body, "v")
    assert (fields["input"], fields["voice"], fields["speed"], fields["seed"]) == (TEXT, "v", 1.0, 7)
