"""Stream speech from the ``tts`` model over gRPC (bidirectional stream) or HTTP (``generate_stream``).

Each yielded :class:`Chunk` holds mono 24 kHz float32 samples and its arrival time. Closing the
iterator early cancels the request on the server. Every wait has a timeout.
"""

from __future__ import annotations

import http.client
import json
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

SAMPLE_RATE = 24000


class TTSError(RuntimeError):
    """The server rejected or failed the request; ``str(e)`` is the server's message."""


@dataclass(frozen=True)
class Chunk:
    audio: np.ndarray  # (n,) float32 at 24 kHz
    arrival: float  # seconds since the request was sent


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlsplit(url if "://" in url else f"//{url}")
    return u.hostname or "127.0.0.1", u.port or default_port


class TTSClient:
    def __init__(self, url: str, protocol: str = "grpc", timeout: float = 60.0, model: str = "tts"):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.protocol, self.timeout, self.model = protocol, timeout, model
        self.host, self.port = _host_port(url, 8001 if protocol == "grpc" else 8000)

    def stream(
        self,
        text: str,
        language: str | None = None,
        ref_audio: np.ndarray | None = None,
        ref_sample_rate: int | None = None,
        ref_text: str | None = None,
        voice_id: str | None = None,
        seed: int | None = None,
        parameters: dict | None = None,
    ) -> Iterator[Chunk]:
        fields = {"TEXT": text, "LANGUAGE": language, "REF_TEXT": ref_text, "VOICE_ID": voice_id, "SEED": seed}
        if ref_audio is not None:
            fields["REF_AUDIO"] = np.asarray(ref_audio, np.float32).reshape(-1)
            fields["REF_SAMPLE_RATE"] = ref_sample_rate
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.protocol == "grpc":
            return self._grpc(fields, parameters or {})
        return self._http(fields, parameters or {})

    def synthesize(self, text: str, **kw) -> np.ndarray:
        """The whole utterance as one array."""
        chunks = [c.audio for c in self.stream(text, **kw)]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    def _grpc(self, fields: dict, parameters: dict) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, v in fields.items():
            if name == "REF_AUDIO":
                arr, dt = v, "FP32"
            elif name == "REF_SAMPLE_RATE":
                arr, dt = np.array([v], np.int32), "INT32"
            elif name == "SEED":
                arr, dt = np.array([v], np.int64), "INT64"
            else:
                arr, dt = np.array([str(v).encode("utf-8")], np.object_), "BYTES"
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client = grpcclient.InferenceServerClient(f"{self.host}:{self.port}")
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=self.timeout * 10)
        t0 = time.perf_counter()
        done = False
        try:
            client.async_stream_infer(self.model, inputs, parameters=parameters, enable_empty_final_response=True)
            while not done:
                try:
                    result, error = q.get(timeout=self.timeout)
                except queue.Empty:
                    raise TimeoutError(f"no response from the server for {self.timeout:.0f} s") from None
                if error is not None:
                    done = True
                    raise TTSError(error.message() if hasattr(error, "message") else str(error))
                done = result.get_response().parameters["triton_final_response"].bool_param
                audio = result.as_numpy("AUDIO")
                if audio is not None and audio.size:
                    yield Chunk(audio.astype(np.float32).reshape(-1), time.perf_counter() - t0)
        finally:
            client.stop_stream(cancel_requests=not done)
            client.close()

    def _http(self, fields: dict, parameters: dict) -> Iterator[Chunk]:
        body = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
        if parameters:
            body["parameters"] = parameters
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", f"/v2/models/{self.model}/generate_stream", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:
                raise TTSError(_error_text(resp.read()))
            for line in resp:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise TTSError(event["error"])
                audio = np.asarray(event.get("AUDIO", []), np.float32).reshape(-1)
                if audio.size:
                    yield Chunk(audio, time.perf_counter() - t0)
        finally:
            conn.close()


def _error_text(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")
