"""Python client for the FireRedTTS3 Triton server (gRPC streaming and HTTP generate_stream)."""

from client.tts_client import Chunk, TTSClient, TTSError

__all__ = ["Chunk", "TTSClient", "TTSError"]
