"""One stereo rule: a two-channel reference becomes the mean of its channels wherever a file is read.

The expectation is the mean computed here, in float64 (exact for two float32 channels) and rounded once
to float32; the paths under test are offline synthesis (``python -m engine.synthesize --ref-audio``),
the client's reader and the gateway's upload decoder.
"""

from __future__ import annotations

import numpy as np
import soundfile as sf

from client.audio_io import read_audio
from engine.audio import load_audio
from engine.synthesize import main as synthesize_main
from gateway.body import decode_blocks

RATE = 16000


def _channels() -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(RATE // 2) / RATE  # 0.5 s: a few patches of prompt at 24 kHz
    left = 0.4 * np.sin(2 * np.pi * 220 * t)
    right = 0.3 * np.sin(2 * np.pi * 530 * t + 1.0) * np.exp(-3 * t)
    return left.astype(np.float32), right.astype(np.float32)


def _files(tmp_path):
    left, right = _channels()
    assert not np.array_equal(left, right)
    mean = ((left.astype(np.float64) + right) / 2).astype(np.float32)
    stereo, mono = tmp_path / "stereo.wav", tmp_path / "mean.wav"
    sf.write(str(stereo), np.stack([left, right], axis=1), RATE, subtype="FLOAT")
    sf.write(str(mono), mean, RATE, subtype="FLOAT")
    return stereo, mono, mean


def test_every_reader_takes_the_mean_of_the_channels(tmp_path):
    stereo, _, mean = _files(tmp_path)
    offline, offline_rate = load_audio(stereo)
    client, client_rate = read_audio(stereo)
    with sf.SoundFile(str(stereo)) as f:
        gateway = decode_blocks(f, limit=len(mean), block=1000)  # several blocks, the last one partial
    assert offline_rate == client_rate == RATE
    for got in (offline, client, gateway):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, mean)


def test_offline_synthesis_of_a_stereo_reference_is_that_of_its_mean(tiny_ckpt, tmp_path):
    stereo, mono, _ = _files(tmp_path)

    def synthesize(ref, out):
        argv = ["--checkpoint", str(tiny_ckpt), "--text", "Hello there.", "--ref-audio", str(ref)]
        argv += ["--ref-text", "a voice", "--max-patches", "6", "--out", str(out)]
        assert synthesize_main(argv) == 0
        return out.read_bytes()

    assert synthesize(stereo, tmp_path / "s.wav") == synthesize(mono, tmp_path / "m.wav")
