import numpy as np
import pytest
import soundfile as sf

from engine.audio import left_pad_to_multiple, load_audio, write_wav
from engine.fbank import SPK_SAMPLE_RATE, kaldi_fbank
from engine.protocol import SAMPLE_RATE
from engine.resample import resample, resample_sinc


def _sine(freq: float, sr: int, seconds: float = 1.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, sr: int) -> float:
    n = 1 << 20  # zero-padded FFT: bins of sr / 2**20 Hz (< 0.03 Hz)
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x)), n))
    return float(np.argmax(spectrum)) * sr / n


_RATE_PAIRS = [(16000, SAMPLE_RATE), (44100, SAMPLE_RATE), (SAMPLE_RATE, SPK_SAMPLE_RATE)]


@pytest.mark.parametrize("method", ["sinc", "soxr"])
@pytest.mark.parametrize(("sr_in", "sr_out"), _RATE_PAIRS)
def test_resample_keeps_frequency_and_duration(sr_in, sr_out, method):
    x = _sine(440.0, sr_in)
    y = resample(x, sr_in, sr_out, method=method)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - len(x) * sr_out / sr_in) <= 1
    assert abs(_peak_hz(y, sr_out) - 440.0) < 1.0
    mid = slice(len(y) // 4, 3 * len(y) // 4)  # away from the filter's edge effects
    assert np.max(np.abs(y[mid])) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize(("sr_in", "sr_out"), _RATE_PAIRS)
def test_resample_sinc_tracks_sine_sample_by_sample(sr_in, sr_out):
    # A 1 kHz tone well inside both bands comes out as the same tone sampled at sr_out,
    # with no delay: the filter is centred on each output instant.
    x = _sine(1000.0, sr_in)
    y = resample_sinc(x, sr_in, sr_out)
    expected = _sine(1000.0, sr_out, len(y) / sr_out)
    mid = slice(len(y) // 10, -len(y) // 10)
    np.testing.assert_allclose(y[mid], expected[mid], atol=2e-3)


@pytest.mark.parametrize(("sr_in", "sr_out"), [*_RATE_PAIRS, (48000, 24000), (22050, 16000)])
@pytest.mark.parametrize("n", [1, 2, 3, 146, 147, 148, 1001, 44100])
def test_resample_sinc_output_length(sr_in, sr_out, n):
    y = resample_sinc(np.ones(n, np.float32), sr_in, sr_out)
    assert y.shape == (-(-sr_out * n // sr_in),)  # ceil(sr_out * n / sr_in)
    assert y.dtype == np.float32


def test_resample_sinc_matches_torchaudio_golden():
    # Values of torchaudio.functional.resample(torch.from_numpy(x), sr_in, sr_out) with its
    # defaults (sinc_interp_hann, lowpass_filter_width=6, rolloff=0.99), torchaudio 2.11 on CPU,
    # at the listed output indices. resample_sinc matched it exactly (max abs diff 0.0) on these
    # inputs and on 2 s of noise and a chirp at 16k->24k, 44.1k->24k, 48k->24k and 24k->16k.
    t = np.arange(4410) / 44100
    x = (0.5 * np.sin(2 * np.pi * (300 * t + 40000 * t**2)) + 0.2 * np.sin(2 * np.pi * 9000 * t)).astype(np.float32)
    y = resample_sinc(x, 44100, SAMPLE_RATE)
    assert y.shape == (2400,)
    idx = [0, 1, 7, 100, 1111, 1800, 2399]
    expected = [
        0.060193486511707306,
        0.1597093939781189,
        0.13115185499191284,
        -0.17105084657669067,
        -0.44409915804862976,
        2.2020398319000378e-05,
        -0.4989750385284424,
    ]
    np.testing.assert_allclose(y[idx], expected, rtol=0, atol=2e-6)

    x2 = (0.5 * np.sin(2 * np.pi * 300 * np.arange(2400) / SAMPLE_RATE)).astype(np.float32)
    y2 = resample_sinc(x2, SAMPLE_RATE, SPK_SAMPLE_RATE)
    assert y2.shape == (1600,)
    expected2 = [0.0038480940274894238, 0.2778766453266144, -2.377191776758991e-10, -0.05812542140483856]
    np.testing.assert_allclose(y2[[0, 5, 800, 1599]], expected2, rtol=0, atol=2e-6)


def test_resample_default_is_sinc():
    x = np.random.default_rng(1).standard_normal(2000).astype(np.float32)
    np.testing.assert_array_equal(resample(x, 44100, SAMPLE_RATE), resample_sinc(x, 44100, SAMPLE_RATE))
    assert not np.array_equal(resample(x, 44100, SAMPLE_RATE, method="soxr"), resample_sinc(x, 44100, SAMPLE_RATE))


@pytest.mark.parametrize("method", ["sinc", "soxr"])
def test_resample_identity_and_errors(method):
    x = _sine(440.0, SAMPLE_RATE, 0.1)
    np.testing.assert_array_equal(resample(x, SAMPLE_RATE, SAMPLE_RATE, method=method), x)
    with pytest.raises(ValueError):
        resample(x, 0, SAMPLE_RATE, method=method)
    with pytest.raises(ValueError):
        resample(x, SAMPLE_RATE, -1, method=method)
    with pytest.raises(ValueError):
        resample(np.zeros((2, 100), np.float32), 16000, 24000, method=method)


def test_resample_sinc_identity_and_errors():
    x = _sine(440.0, SAMPLE_RATE, 0.1)
    np.testing.assert_array_equal(resample_sinc(x, SAMPLE_RATE, SAMPLE_RATE), x)
    np.testing.assert_array_equal(resample_sinc(x.astype(np.float64), 16000, 16000), x)  # cast to float32
    with pytest.raises(ValueError):
        resample_sinc(x, 16000, 0)
    with pytest.raises(ValueError):
        resample_sinc(np.zeros((1, 100), np.float32), 16000, 24000)
    with pytest.raises(ValueError, match="unknown resampling method"):
        resample(x, 16000, 24000, method="linear")


def test_left_pad_to_multiple():
    x = np.arange(1, 1001, dtype=np.float32)
    y = left_pad_to_multiple(x, 3840)
    assert len(y) == 3840
    assert not y[: 3840 - 1000].any()
    np.testing.assert_array_equal(y[-1000:], x)
    assert len(left_pad_to_multiple(np.ones(3840 * 2 + 1, np.float32), 3840)) == 3840 * 3
    exact = np.ones(3840, np.float32)
    np.testing.assert_array_equal(left_pad_to_multiple(exact, 3840), exact)
    with pytest.raises(ValueError):
        left_pad_to_multiple(x, 0)


def test_wav_round_trip_float_is_exact(tmp_path):
    x = _sine(440.0, SAMPLE_RATE, 0.5) * 1.7  # also past full scale: FLOAT keeps it
    path = tmp_path / "a.wav"
    write_wav(path, x)
    info = sf.info(str(path))
    assert (info.samplerate, info.channels, info.format) == (SAMPLE_RATE, 1, "WAV")
    y, sr = load_audio(path)
    assert sr == SAMPLE_RATE and y.dtype == np.float32
    np.testing.assert_array_equal(y, x)


def test_wav_round_trip_pcm16(tmp_path):
    x = _sine(440.0, SAMPLE_RATE, 0.5)
    path = tmp_path / "a.wav"
    write_wav(path, x, subtype="PCM_16")
    assert sf.info(str(path)).subtype == "PCM_16"
    y, sr = load_audio(path)
    assert sr == SAMPLE_RATE
    np.testing.assert_allclose(y, x, atol=1 / 32768)


def test_load_audio_averages_channels(tmp_path):
    left, right = _sine(440.0, 16000, 0.1), _sine(1000.0, 16000, 0.1)
    path = tmp_path / "stereo.wav"
    sf.write(str(path), np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    y, sr = load_audio(path)
    assert sr == 16000 and y.shape == left.shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, ((left.astype(np.float64) + right) / 2).astype(np.float32))


def test_load_audio_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.wav"):
        load_audio(tmp_path / "nope.wav")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio" * 10)
    with pytest.raises(ValueError, match="junk.wav"):
        load_audio(junk)


@pytest.mark.parametrize("n", [400, 401, 559, 560, 16000, 24321])
def test_fbank_shape_and_zero_mean(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.1
    f = kaldi_fbank(x)
    assert f.shape == (1 + (n - 400) // 160, 80) and f.dtype == np.float32
    np.testing.assert_allclose(f.mean(axis=0), 0.0, atol=1e-4)


def test_fbank_rejects_short_or_2d_input():
    with pytest.raises(ValueError, match="too short"):
        kaldi_fbank(np.zeros(399, np.float32))
    with pytest.raises(ValueError):
        kaldi_fbank(np.zeros((1, 16000), np.float32))


def test_fbank_matches_torchaudio_golden():
    # Values of torchaudio.compliance.kaldi.fbank(x, num_mel_bins=80, dither=0,
    # sample_frequency=16000) minus its time mean (the reference's call), at frames
    # [0, 12, 24, 36, 47] and bins [0, 20, 40, 60, 79], for a chirp with a tone onset.
    t = np.arange(SPK_SAMPLE_RATE // 2) / SPK_SAMPLE_RATE
    x = 0.5 * np.sin(2 * np.pi * (200 * t + 1500 * t**2)) + 0.1 * np.sin(2 * np.pi * 3000 * t) * (t > 0.25)
    expected = np.array(
        [
            [1.7298, -4.1801, -4.1938, -1.4092, -0.4839],
            [-3.8100, 9.1195, -3.7345, -1.4092, -0.4839],
            [-0.6705, 0.0890, 7.6744, 12.3481, 11.9748],
            [-1.8113, -3.8202, 2.5962, 0.1476, -0.4839],
            [-1.0995, -6.9441, 9.6166, 0.1457, -0.4839],
        ]
    )
    f = kaldi_fbank(x.astype(np.float32))
    assert f.shape == (48, 80)
    np.testing.assert_allclose(f[np.ix_([0, 12, 24, 36, 47], [0, 20, 40, 60, 79])], expected, atol=0.02)
