"""Output sample rates: the model's 24 kHz audio converted, chunk by chunk, to the rate a caller asks for
(8 kHz for telephony, 16 kHz for speech recognisers and agent pipelines, 22.05/44.1/48 kHz for players).

libsoxr's streaming resampler keeps its filter state between chunks, so a stream converted chunk by chunk is
sample for sample the audio converted whole (``soxr.resample``): round(N x rate / 24000) samples for N in.
It holds back a few milliseconds (the filter's delay) until the next chunk, and the rest on ``finish``.
"""

from __future__ import annotations

import numpy as np
import soxr

from engine.params import shown
from engine.protocol import SAMPLE_RATE

# Cartesia's output_format.sample_rate values, and 32000 (ElevenLabs' pcm_32000); 24000 is the model's own
RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
QUALITY = "HQ"  # libsoxr's default: VHQ costs more per chunk and cannot be heard at these rates
# formats that carry samples as they are (raw, or WAV's header and raw), so at any rate; the
# codecs of gateway.encode stay at 24 kHz
RATED_FORMATS = ("pcm", "wav", "pcm_mulaw", "pcm_alaw", "pcm_f32le")
TELEPHONY_RATE = 8000  # G.711's rate, the default for pcm_mulaw and pcm_alaw
G711_FORMATS = ("pcm_mulaw", "pcm_alaw")


def default_rate(response_format: str) -> int:
    return TELEPHONY_RATE if response_format in G711_FORMATS else SAMPLE_RATE


def check_rate(response_format: str, sample_rate) -> int:
    """A request's ``sample_rate`` (None: the format's default; a client's list or object comes as
    ``gateway.fields.Described``) -> the rate in Hz; ValueError with a message a user can act on for a rate
    not in :data:`RATES` or a format that cannot change its rate."""
    if sample_rate is None:
        return default_rate(response_format)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate not in RATES:
        raise ValueError(f"sample_rate must be one of {list(RATES)} (Hz), got {shown(sample_rate)}")
    if sample_rate != SAMPLE_RATE and response_format not in RATED_FORMATS:
        raise ValueError(
            f"sample_rate applies to response_format {', '.join(RATED_FORMATS)}; "
            f"{response_format} is always {SAMPLE_RATE} Hz"
        )
    return sample_rate


class StreamResampler:
    """Mono float32 audio at ``rate_in`` Hz -> at ``rate_out`` Hz, chunk by chunk: ``push(chunk)`` for each
    chunk (N,), then ``finish()`` once for the held-back tail. Equal rates pass the audio through."""

    def __init__(self, rate_out: int, rate_in: int = SAMPLE_RATE):
        self.rate_in, self.rate_out = rate_in, rate_out
        self.stream = None if rate_in == rate_out else soxr.ResampleStream(rate_in, rate_out, 1, "float32", QUALITY)
        self.finished = False

    def push(self, audio: np.ndarray) -> np.ndarray:
        return self._convert(audio, last=False)

    def finish(self) -> np.ndarray:
        return self._convert(np.zeros(0, np.float32), last=True)

    def _convert(self, audio: np.ndarray, last: bool) -> np.ndarray:
        if self.finished:
            raise RuntimeError("the stream was finished: a resampler converts one stream")
        self.finished = last
        audio = np.ascontiguousarray(audio, np.float32).reshape(-1)
        if self.stream is None:
            return audio
        return self.stream.resample_chunk(audio, last=last)
