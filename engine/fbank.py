"""Kaldi log-mel filterbank features for the CAM++ speaker encoder, as the reference computes them.

Mono float32 audio (N,) at 16 kHz in, (T, 80) frames of 10 ms out.
"""

from __future__ import annotations

import kaldi_native_fbank as knf
import numpy as np

from engine.audio import as_mono_float32

SPK_SAMPLE_RATE = 16000
"""Rate the CAM++ speaker encoder was trained at; its fbank is computed at 16 kHz."""

FBANK_BINS = 80
FBANK_WINDOW = 400  # 25 ms at 16 kHz: a signal shorter than this has no frame


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
    audio = as_mono_float32(audio_16k, "audio_16k")
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
