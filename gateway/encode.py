"""Streaming audio encoders for the speech endpoint: float32 24 kHz mono chunks in, container bytes out
as soon as the codec emits them.

``wav`` and ``pcm`` are 16-bit little-endian PCM written here (a WAV header whose sizes say "unknown
length", as streaming WAV does), ``pcm_mulaw`` and ``pcm_alaw`` the same samples as G.711's 8-bit codes
(:mod:`gateway.g711`), ``pcm_f32le`` the float samples unquantized (clipped); these five come at any rate of
:data:`gateway.rates.RATES`. ``flac``, ``mp3``, ``opus`` (in Ogg) and ``aac`` (ADTS) are encoded and muxed by
FFmpeg through PyAV, at 24 kHz unless a rate is given (the vendor dialects' MP3 and Opus rates,
:mod:`gateway.dialects`; the OpenAI route keeps them at 24 kHz, :func:`gateway.rates.check_rate`).

``flac`` alone is written whole: its STREAMINFO header carries the total length, which a stream cannot
know up front, and libsndfile refuses a FLAC that leaves it out (``soundfile.read``: "array is too big").
FFmpeg rewrites the header at the end when its output is seekable, so the file is muxed into memory and
sent once the utterance is done: the first byte waits for the last chunk (the whole synthesis time).
"""

from __future__ import annotations

import io
import struct

import numpy as np

from engine.protocol import SAMPLE_RATE
from gateway.g711 import alaw_encode, mulaw_encode
from gateway.rates import StreamResampler, default_rate

# response_format -> (MIME type, PyAV container format, codec); None: written here
FORMATS = {
    "mp3": ("audio/mpeg", "mp3", "libmp3lame"),
    "opus": ("audio/ogg", "ogg", "libopus"),
    "aac": ("audio/aac", "adts", "aac"),
    "flac": ("audio/flac", "flac", "flac"),
    "wav": ("audio/wav", None, None),
    "pcm": ("audio/pcm", None, None),
    "pcm_mulaw": ("audio/PCMU", None, None),  # RFC 3551's names for G.711
    "pcm_alaw": ("audio/PCMA", None, None),
    "pcm_f32le": ("audio/pcm", None, None),  # 32-bit float little-endian (Cartesia's encoding of that name)
}
G711 = {"pcm_mulaw": mulaw_encode, "pcm_alaw": alaw_encode}
WHOLE = {"flac"}  # formats sent whole, once the utterance is done (see above)
# bits per second for mono 24 kHz speech: FFmpeg's defaults would give MP3 32 kb/s, which smears it
BIT_RATES = {"mp3": 64_000, "aac": 64_000, "opus": 32_000}


def pcm16(audio: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> 16-bit little-endian PCM (clipped)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


# a raw format -> its WAV format tag and bits a sample (RFC 2361: 1 PCM, 3 IEEE float, 6 A-law, 7 mu-law)
WAV_CODES = {"pcm": (1, 16), "pcm_f32le": (3, 32), "pcm_alaw": (6, 8), "pcm_mulaw": (7, 8)}


def wav_header(sample_rate: int = SAMPLE_RATE, samples: str = "pcm") -> bytes:
    """A mono WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF) whose samples are a
    raw format of :data:`WAV_CODES` (16-bit PCM by default; the others get the 18-byte fmt chunk they need)."""
    unknown = 0xFFFFFFFF
    tag, bits = WAV_CODES[samples]
    fmt = struct.pack("<HHIIHH", tag, 1, sample_rate, sample_rate * bits // 8, bits // 8, bits)
    if tag != 1:
        fmt += struct.pack("<H", 0)  # cbSize: no extra format bytes
    sizes = struct.pack("<I", unknown)
    return b"RIFF" + sizes + b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + sizes


class _Sink:
    """A write-only file object that keeps what the muxer wrote until it is taken."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out

    def flush(self) -> None:
        pass


class Encoder:
    """``push(chunk) -> bytes`` for each chunk, then ``finish() -> bytes``. ``sample_rate``: the output rate
    (None: 8000 for G.711, else 24000), checked by :func:`gateway.rates.check_rate` (or a dialect's own table:
    a codec's rate must be one it takes)."""

    def __init__(self, response_format: str, sample_rate: int | None = None):
        if response_format not in FORMATS:
            raise ValueError(f"response_format must be one of {sorted(FORMATS)}, got {response_format!r}")
        self.format = response_format
        self.media_type, container, codec = FORMATS[response_format]
        self.started, self.out = False, None
        self.rate = sample_rate or default_rate(response_format)
        if container is None:
            self.converter = StreamResampler(self.rate)
            if response_format in G711:
                self.media_type += f";rate={self.rate}"
            return
        import av

        self.sink = io.BytesIO() if response_format in WHOLE else _Sink()  # seekable: the header is rewritten
        self.out = av.open(self.sink, mode="w", format=container)
        self.stream = self.out.add_stream(codec, rate=self.rate, layout="mono")
        if response_format in BIT_RATES:
            self.stream.codec_context.bit_rate = BIT_RATES[response_format]
        fmt = self.stream.codec_context.codec.audio_formats[0].name  # the codec's preferred sample format
        self.resampler = av.AudioResampler(format=fmt, layout="mono", rate=self.rate)
        self.pts = 0

    def push(self, audio: np.ndarray) -> bytes:
        audio = np.asarray(audio, np.float32).reshape(-1)
        if self.out is None:
            return self._samples(self.converter.push(audio))
        if audio.size:
            self._encode(audio)
        return b"" if self.format in WHOLE else self.sink.take()

    def _samples(self, audio: np.ndarray) -> bytes:
        """Raw formats: 16-bit PCM (after a WAV header, first), its G.711 codes, or 32-bit floats."""
        head = wav_header(self.rate) if self.format == "wav" and not self.started else b""
        self.started = True
        if self.format == "pcm_f32le":
            return np.clip(audio, -1.0, 1.0).astype("<f4").tobytes()
        samples = pcm16(audio)
        if self.format in G711:
            samples = G711[self.format](np.frombuffer(samples, "<i2")).tobytes()
        return head + samples

    def _encode(self, audio: np.ndarray | None) -> None:
        import av

        if audio is None:
            packets = self.stream.encode(None)
        else:
            # quantized here, as for wav: every format carries the same 16-bit samples (FFmpeg's own
            # float -> s16 scales by 32768, ours by 32767)
            samples = np.frombuffer(pcm16(audio), "<i2")[None]
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, self.pts
            self.pts += audio.size
            packets = [p for f in self.resampler.resample(frame) for p in self.stream.encode(f)]
        for packet in packets:
            self.out.mux(packet)

    def finish(self) -> bytes:
        if self.out is None:
            return self._samples(self.converter.finish())
        self._encode(None)
        self.out.close()
        return self.sink.getvalue() if self.format in WHOLE else self.sink.take()
