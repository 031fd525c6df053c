"""Audio in and out for the client: read a reference voice, write WAV as chunks arrive, raw PCM to a pipe.

Output is 16-bit PCM (the format every player and ``aplay``/``ffplay`` take without options).
"""

from __future__ import annotations

import io
import os
import wave
from typing import BinaryIO

import numpy as np

from engine.audio import downmix
from engine.protocol import SAMPLE_RATE


def pcm16(audio: np.ndarray) -> bytes:
    """(n,) float samples in [-1, 1] -> n little-endian signed 16-bit samples (clipped)."""
    a = np.clip(np.asarray(audio, np.float32).reshape(-1), -1.0, 1.0)
    return np.round(a * 32767.0).astype("<i2").tobytes()


class WavWriter:
    """A mono 16-bit WAV written chunk by chunk; the header is finalised on :meth:`close`.

    Args:
        path: the file to (over)write.
        sample_rate: Hz (the server sends 24 kHz).
    """

    def __init__(self, path: str | os.PathLike, sample_rate: int = SAMPLE_RATE):
        self.path = os.fspath(path)
        self._w = wave.open(self.path, "wb")
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(sample_rate)

    def write(self, audio: np.ndarray) -> None:
        """Append (n,) float samples."""
        self._w.writeframes(pcm16(audio))

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> WavWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_wav(path: str | os.PathLike, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write (n,) float samples as a mono 16-bit WAV."""
    with WavWriter(path, sample_rate) as w:
        w.write(audio)


def write_pcm(out: BinaryIO, audio: np.ndarray) -> None:
    """Append (n,) float samples to a binary stream as raw s16le and flush, so a player downstream starts now."""
    out.write(pcm16(audio))
    out.flush()


def read_audio(path: str | os.PathLike | io.BytesIO) -> tuple[np.ndarray, int]:
    """Any file libsndfile reads (a path, or its bytes in a BytesIO) -> ((n,) float32 mono, sample rate in
    Hz); channels are averaged (:func:`engine.audio.downmix`, as offline synthesis does)."""
    import soundfile as sf

    audio, sr = sf.read(path if isinstance(path, io.BytesIO) else os.fspath(path), dtype="float32", always_2d=True)
    if audio.size == 0:
        raise ValueError(f"{'the upload' if isinstance(path, io.BytesIO) else path}: no audio samples")
    return downmix(audio), int(sr)
