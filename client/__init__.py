"""Python client for the FireRedTTS3 Triton server (gRPC streaming, sync and asyncio; HTTP generate_stream).

``python -m client --help`` for the command line.
"""

from client.aio import AsyncTTSClient
from client.audio_io import WavWriter, read_audio, write_pcm, write_wav
from client.text_in import AsyncTextStream, Flushed
from client.tts_client import (
    Chunk,
    Forbidden,
    InvalidRequest,
    NotFound,
    ServerBusy,
    ServerUnavailable,
    TTSClient,
    TTSError,
)
from engine.protocol import SAMPLE_RATE

__all__ = [
    "SAMPLE_RATE",
    "AsyncTTSClient",
    "AsyncTextStream",
    "Chunk",
    "Flushed",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "ServerBusy",
    "ServerUnavailable",
    "TTSClient",
    "TTSError",
    "WavWriter",
    "read_audio",
    "write_pcm",
    "write_wav",
]
