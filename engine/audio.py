"""Audio I/O and signal helpers shared by the prompt encoder and the clients.

Every function takes and returns mono float32 numpy arrays of samples; only
`resample_sinc` uses torch, imported when first called. Sample rates are in Hz.
"""

from __future__ import annotations

import math
import os
import struct
from typing import TYPE_CHECKING

import kaldi_native_fbank as knf
import numpy as np
import soundfile as sf
import soxr

from engine.protocol import MAX_REFERENCE_SECONDS

if TYPE_CHECKING:
    import torch

SAMPLE_RATE = 24000
"""Rate of the RedAE codec: prompts are encoded and speech is generated at 24 kHz."""

SPK_SAMPLE_RATE = 16000
"""Rate the CAM++ speaker encoder was trained at; its fbank is computed at 16 kHz."""

REFERENCE_RATES = (8000, 192000)
"""Sample rates (Hz) accepted for a reference clip."""

MAX_REFERENCE_PEAK = 4.0
"""Largest reference sample magnitude accepted (+12 dBFS): room for inter-sample overs and float
masters without headroom, far below integer PCM sent as float (peaks in the hundreds to 32767)."""

FBANK_BINS = 80
FBANK_WINDOW = 400  # 25 ms at 16 kHz: a signal shorter than this has no frame
FBANK_HOP = 160  # 10 ms at 16 kHz


def _as_mono_float32(audio: np.ndarray, what: str = "audio") -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of samples, got shape {audio.shape}")
    return audio.astype(np.float32, copy=False)


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

    A multi-channel file keeps only its first channel, as the reference does
    (`audio[:1]`), rather than averaging channels.

    Returns:
        (samples, sample_rate): samples is float32 with shape (N,), in [-1, 1] for
        integer PCM files.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file cannot be decoded or holds no samples.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"cannot read audio file {path}: {e}") from e
    if data.shape[0] == 0:
        raise ValueError(f"audio file {path} holds no samples")
    return np.ascontiguousarray(data[:, 0]), int(sr)


def wav_bytes(audio: np.ndarray, sr: int = SAMPLE_RATE) -> bytes:
    """A mono 32-bit float WAV file as bytes: RIFF with fmt, fact and data chunks only.

    Written by hand because libsndfile adds a PEAK chunk with a timestamp to float files, so the same
    samples would not give the same bytes twice.
    """
    audio = _as_mono_float32(audio)
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
    audio = _as_mono_float32(audio)
    if subtype == "FLOAT":
        with open(path, "wb") as f:
            f.write(wav_bytes(audio, sr))
        return
    if sr <= 0:
        raise ValueError(f"sample rate must be positive, got {sr}")
    sf.write(os.fspath(path), np.clip(audio, -1.0, 1.0), int(sr), subtype=subtype, format="WAV")


SINC_LOWPASS_WIDTH = 6
"""Zero crossings of the windowed sinc on each side of a tap, at the lower of the two rates."""

SINC_ROLLOFF = 0.99
"""Cutoff of the sinc resampler as a fraction of the lower rate's Nyquist frequency."""


def _sinc_kernel(orig: int, new: int, dtype) -> tuple[torch.Tensor, int]:
    """Polyphase filter bank of the Hann-windowed sinc resampler, for rates already divided by their gcd.

    Returns (kernel, half_width): kernel has shape (new, 1, 2 * half_width + orig); row j holds the
    taps that make output sample j of each block of `new` outputs from a window of input samples.
    """
    import torch

    cutoff = min(orig, new) * SINC_ROLLOFF  # in units of the reduced rates
    half_width = math.ceil(SINC_LOWPASS_WIDTH * orig / cutoff)
    # Time of each input tap relative to each output phase, in input periods, then scaled so
    # the sinc's zero crossings land on integers. The operation order is kept as in torchaudio
    # so that the float32 taps come out identical.
    taps = torch.arange(-half_width, half_width + orig, dtype=dtype)[None, None] / orig
    phases = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new
    x = (phases + taps) * cutoff
    x = x.clamp(-SINC_LOWPASS_WIDTH, SINC_LOWPASS_WIDTH)
    hann = torch.cos(x * math.pi / SINC_LOWPASS_WIDTH / 2) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.ones((), dtype=dtype), torch.sin(x) / x)
    return sinc * (hann * (cutoff / orig)), half_width


def resample_sinc(audio: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling with a Hann-windowed sinc, equivalent to the reference's resampler.

    Same algorithm as ``torchaudio.functional.resample(x, sr_in, sr_out)`` with its defaults
    (``sinc_interp_hann``, lowpass_filter_width 6, rolloff 0.99), which FireRedTTS3 uses on
    reference audio: the rates are divided by their gcd, a polyphase bank of `sr_out / g` filters is
    built, the input is zero-padded and convolved with a stride of `sr_in / g`, and the interleaved
    phases are cut to ceil(sr_out * N / sr_in) samples. Computed in float32, as torchaudio does for
    a float32 waveform. Imports torch on first use.

    Returns the input (as float32) when the rates are equal.
    """
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive, got {sr_in} -> {sr_out}")
    audio = _as_mono_float32(audio)
    if sr_in == sr_out:
        return audio

    import torch
    import torch.nn.functional as F

    g = math.gcd(int(sr_in), int(sr_out))
    orig, new = int(sr_in) // g, int(sr_out) // g
    n = audio.shape[0]
    kernel, half_width = _sinc_kernel(orig, new, torch.float32)
    x = torch.from_numpy(np.ascontiguousarray(audio))[None, None]
    x = F.pad(x, (half_width, half_width + orig))
    with torch.inference_mode():
        phases = F.conv1d(x, kernel, stride=orig)  # (1, new, blocks)
    out = phases[0].T.reshape(-1)  # block by block, phase by phase
    out_len = math.ceil(new * n / orig)
    return out[:out_len].numpy().astype(np.float32, copy=True)


def resample(audio: np.ndarray, sr_in: int, sr_out: int, method: str = "sinc") -> np.ndarray:
    """Resamples mono audio.

    Args:
        audio: float samples, shape (N,).
        sr_in, sr_out: rates in Hz.
        method: "sinc" (default): `resample_sinc`, the reference's windowed-sinc resampler
            (torchaudio's default), which prompt encoding and the speaker embedding need to
            match the reference; output has ceil(N * sr_out / sr_in) samples.
            "soxr": libsoxr at 'VHQ' quality, round(N * sr_out / sr_in) samples, no added delay;
            differs from the reference slightly near Nyquist.

    Returns the input (as float32) when the rates are equal, whatever the method.
    """
    if method not in ("sinc", "soxr"):
        raise ValueError(f"unknown resampling method {method!r}; expected 'sinc' or 'soxr'")
    if sr_in <= 0 or sr_out <= 0:
        raise ValueError(f"sample rates must be positive, got {sr_in} -> {sr_out}")
    audio = _as_mono_float32(audio)
    if sr_in == sr_out:
        return audio
    if method == "sinc":
        return resample_sinc(audio, sr_in, sr_out)
    return soxr.resample(audio, sr_in, sr_out, quality="VHQ").astype(np.float32, copy=False)


def left_pad_to_multiple(audio: np.ndarray, multiple: int) -> np.ndarray:
    """Prepends zeros so the length becomes a multiple of `multiple` samples.

    The reference pads prompts on the left, so the prompt's last sample stays next
    to the speech that is generated after it.
    """
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    audio = _as_mono_float32(audio)
    pad = -audio.shape[0] % multiple
    if pad == 0:
        return audio
    return np.concatenate([np.zeros(pad, dtype=np.float32), audio])


def _fbank_options() -> knf.FbankOptions:
    # Every option is spelled out to match torchaudio.compliance.kaldi.fbank as the
    # reference calls it (num_mel_bins=80, dither=0, sample_frequency=16000, all else
    # default). kaldi-native-fbank's own defaults differ in dither (3e-5) and
    # energy_floor (0.0).
    opts = knf.FbankOptions()
    frame = opts.frame_opts
    frame.samp_freq = float(SPK_SAMPLE_RATE)
    frame.frame_length_ms = 25.0
    frame.frame_shift_ms = 10.0
    frame.dither = 0.0
    frame.preemph_coeff = 0.97
    frame.remove_dc_offset = True
    frame.window_type = "povey"
    frame.round_to_power_of_two = True  # 400-sample window -> 512-point FFT
    frame.blackman_coeff = 0.42
    frame.snip_edges = True
    mel = opts.mel_opts
    mel.num_bins = FBANK_BINS
    mel.low_freq = 20.0
    mel.high_freq = 0.0  # 0 means Nyquist
    mel.vtln_low = 100.0
    mel.vtln_high = -500.0
    mel.htk_mode = False
    mel.is_librosa = False  # Kaldi mel scale and triangles, no Slaney norm
    opts.use_energy = False
    opts.energy_floor = 1.0  # unused without use_energy
    opts.raw_energy = True
    opts.htk_compat = False
    opts.use_log_fbank = True
    opts.use_power = True
    opts.use_log_floor = True
    opts.eps = float(np.finfo(np.float32).eps)  # torchaudio floors log at float eps
    return opts


def kaldi_fbank(audio_16k: np.ndarray) -> np.ndarray:
    """Kaldi log-mel filterbank for the CAM++ speaker encoder, mean-normalised.

    Samples are used as given, in [-1, 1] (no x32768 scaling, as in the reference);
    the constant scale would vanish in the mean subtraction anyway except at the
    log floor.

    Args:
        audio_16k: float samples at 16 kHz, shape (N,), N >= 400.

    Returns:
        float32 array (T, 80) with T = 1 + (N - 400) // 160 frames of 10 ms, each
        bin's mean over time subtracted.
    """
    audio = _as_mono_float32(audio_16k, "audio_16k")
    if audio.shape[0] < FBANK_WINDOW:
        raise ValueError(
            f"audio too short for a filterbank: {audio.shape[0]} samples at 16 kHz, "
            f"need at least {FBANK_WINDOW} (25 ms)"
        )
    fbank = knf.OnlineFbank(_fbank_options())
    fbank.accept_waveform(float(SPK_SAMPLE_RATE), audio)
    fbank.input_finished()
    feats = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    feats = feats.astype(np.float32, copy=False)
    return feats - feats.mean(axis=0, keepdims=True)
