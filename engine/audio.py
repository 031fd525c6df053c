"""Samples in and out: reference clips checked, audio files read, WAV files written.

Every function takes and returns mono float32 numpy arrays of samples (N,); sample rates are in Hz.
Imports nothing but numpy (libsndfile is loaded when a file is read or written), so the clients can use
it. Resampling is :mod:`engine.resample`, the speaker encoder's features :mod:`engine.fbank`.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from engine.protocol import MAX_REFERENCE_SECONDS, SAMPLE_RATE

REFERENCE_RATES = (8000, 192000)
"""Sample rates (Hz) accepted for a reference clip."""

MAX_REFERENCE_PEAK = 4.0
"""Largest reference sample magnitude accepted (+12 dBFS): room for inter-sample overs and float
masters without headroom, far below integer PCM sent as float (peaks in the hundreds to 32767)."""


def as_mono_float32(audio: np.ndarray, what: str = "audio") -> np.ndarray:
    """``audio`` as float32 samples (N,), not copied when it already is; ValueError naming ``what`` if not 1-D."""
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of samples, got shape {audio.shape}")
    return audio.astype(np.float32, copy=False)


def downmix(frames: np.ndarray) -> np.ndarray:
    """Audio of any channel count -> mono float32 samples (N,): the mean of the channels, frame by frame.

    The one rule for a multi-channel reference, used wherever a file is read (offline synthesis, the
    client, the gateway). Averaging keeps a voice that is on either channel (a one-sided recording,
    a mic on the right), where taking one channel could keep silence; the FireRedTTS3 reference takes
    the first channel (``prompt_audio[:1]``), so a stereo clip whose channels differ gives a
    different prompt here. A mono file is unchanged. The Triton models take mono samples only
    (:func:`check_reference` refuses an (N, C) array), so whoever decodes a file mixes it down.

    Args:
        frames: (N, C) float samples, one row per frame (soundfile's ``always_2d`` layout), or (N,) mono.
    """
    frames = np.asarray(frames, dtype=np.float32)
    if frames.ndim == 1:
        return frames
    if frames.ndim != 2:
        raise ValueError(f"audio frames must be (N,) or (N, channels), got shape {frames.shape}")
    return frames.mean(axis=1)


def check_reference(audio, sample_rate, name: str = "reference audio", rate_name: str = "sample rate") -> np.ndarray:
    """A reference clip -> float32 samples (N,); ValueError naming ``name`` or ``rate_name`` otherwise.

    Refused, never repaired: a non-float dtype, an empty or multi-dimensional array, a rate outside
    REFERENCE_RATES, more than MAX_REFERENCE_SECONDS, NaN or infinite samples, and a peak above
    MAX_REFERENCE_PEAK. Such a peak is almost always integer PCM sent as float; normalising it would
    hide that bug (and turn a clipped or corrupt clip into a plausible-looking voice).
    """
    try:
        audio = np.asarray(audio)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be an array of float samples ({e})") from None
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"{name} must be float samples in [-1, 1], got dtype {audio.dtype}")
    if audio.ndim != 1 or audio.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of samples, got shape {audio.shape}")
    if not sample_rate:
        raise ValueError(f"{rate_name} is required with {name}")
    lo, hi = REFERENCE_RATES
    integer = isinstance(sample_rate, int | np.integer) and not isinstance(sample_rate, bool)
    if not (integer and lo <= sample_rate <= hi):
        raise ValueError(f"{rate_name} must be an integer in {lo}..{hi} Hz, got {sample_rate!r}")
    if audio.size > MAX_REFERENCE_SECONDS * sample_rate:
        seconds = audio.size / sample_rate
        raise ValueError(f"{name} is {seconds:.1f} s at {sample_rate} Hz; the limit is {MAX_REFERENCE_SECONDS:g} s")
    finite = np.isfinite(audio)
    if not finite.all():
        raise ValueError(f"{name} has {audio.size - int(finite.sum())} NaN or infinite samples")
    peak = float(np.abs(audio).max())
    if peak > MAX_REFERENCE_PEAK:
        raise ValueError(
            f"{name} peaks at {peak:.4g}, above the limit of {MAX_REFERENCE_PEAK:g}: samples must be in [-1, 1] "
            "(integer PCM sent as float? scale it to [-1, 1], e.g. int16 / 32768)"
        )
    return audio.astype(np.float32, copy=False)


def load_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Reads an audio file with libsndfile (WAV, FLAC, OGG, ...).

    A multi-channel file is mixed down to mono by :func:`downmix` (the mean of its channels).

    Returns:
        (samples, sample_rate): samples is float32 with shape (N,), in [-1, 1] for
        integer PCM files.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file cannot be decoded or holds no samples.
    """
    import soundfile as sf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"cannot read audio file {path}: {e}") from e
    if data.shape[0] == 0:
        raise ValueError(f"audio file {path} holds no samples")
    return downmix(data), int(sr)


def wav_bytes(audio: np.ndarray, sr: int = SAMPLE_RATE) -> bytes:
    """A mono 32-bit float WAV file as bytes: RIFF with fmt, fact and data chunks only.

    Written by hand because libsndfile adds a PEAK chunk with a timestamp to float files, so the same
    samples would not give the same bytes twice.
    """
    audio = as_mono_float32(audio)
    if sr <= 0:
        raise ValueError(f"sample rate must be positive, got {sr}")
    data = audio.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHHH", 3, 1, int(sr), int(sr) * 4, 4, 32, 0)  # IEEE float, mono, cbSize 0
    chunks = [b"fmt ", struct.pack("<I", len(fmt)), fmt, b"fact", struct.pack("<II", 4, audio.size)]
    chunks += [b"data", struct.pack("<I", len(data)), data]
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def write_wav(path: str | os.PathLike, audio: np.ndarray, sr: int = SAMPLE_RATE, subtype: str = "FLOAT") -> None:
    """Writes a mono WAV file.

    ``FLOAT`` (default) stores the exact float32 samples and the same samples always give the same
    bytes. ``PCM_16`` is the most widely readable (Python's ``wave`` module cannot read float WAV);
    samples are clipped to [-1, 1] first, since libsndfile would otherwise wrap values that overflow.

    Args:
        path: destination file.
        audio: float samples, shape (N,).
        sr: sample rate in Hz.
        subtype: "FLOAT" or a libsndfile PCM subtype such as "PCM_16".
    """
    audio = as_mono_float32(audio)
    if subtype == "FLOAT":
        with open(path, "wb") as f:
            f.write(wav_bytes(audio, sr))
        return
    if sr <= 0:
        raise ValueError(f"sample rate must be positive, got {sr}")
    import soundfile as sf

    sf.write(os.fspath(path), np.clip(audio, -1.0, 1.0), int(sr), subtype=subtype, format="WAV")


def left_pad_to_multiple(audio: np.ndarray, multiple: int) -> np.ndarray:
    """Prepends zeros so the length becomes a multiple of `multiple` samples.

    The reference pads prompts on the left, so the prompt's last sample stays next
    to the speech that is generated after it.
    """
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    audio = as_mono_float32(audio)
    pad = -audio.shape[0] % multiple
    if pad == 0:
        return audio
    return np.concatenate([np.zeros(pad, dtype=np.float32), audio])
