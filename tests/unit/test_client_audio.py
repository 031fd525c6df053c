"""Client audio helpers: PCM conversion, WAV written chunk by chunk, reference audio read as mono."""

from __future__ import annotations

import io
import wave

import numpy as np
import soundfile as sf

from client.audio_io import WavWriter, pcm16, read_audio, write_pcm, write_wav


def test_pcm16_clips_and_rounds():
    got = np.frombuffer(pcm16(np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5], np.float32)), "<i2")
    assert got.tolist() == [0, 32767, -32767, 32767, -32767, 16384]


def test_wav_writer_chunks_equal_one_write(tmp_path):
    audio = np.sin(np.arange(10000) / 30).astype(np.float32) * 0.5
    with WavWriter(tmp_path / "a.wav") as w:
        for part in np.array_split(audio, 7):
            w.write(part)
    write_wav(tmp_path / "b.wav", audio)
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
    with wave.open(str(tmp_path / "a.wav")) as r:
        assert (r.getframerate(), r.getnchannels(), r.getsampwidth(), r.getnframes()) == (24000, 1, 2, 10000)
        assert r.readframes(10000) == pcm16(audio)


def test_write_pcm_appends_raw_samples():
    out = io.BytesIO()
    write_pcm(out, np.zeros(3, np.float32))
    write_pcm(out, np.ones(2, np.float32))
    assert np.frombuffer(out.getvalue(), "<i2").tolist() == [0, 0, 0, 32767, 32767]


def test_read_audio_averages_channels(tmp_path):
    stereo = np.stack([np.full(100, 0.5), np.full(100, -0.25)], axis=1).astype(np.float32)
    sf.write(tmp_path / "s.flac", stereo, 16000)
    audio, sr = read_audio(tmp_path / "s.flac")
    assert sr == 16000 and audio.shape == (100,) and audio.dtype == np.float32
    np.testing.assert_allclose(audio, 0.125, atol=1e-3)
