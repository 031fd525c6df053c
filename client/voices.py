"""Named voices on the server (the ``voices`` model): register once, then synthesize with VOICE_ID."""

from __future__ import annotations

import json

import numpy as np

from client.tts_client import TTSError, _host_port


class VoiceClient:
    def __init__(self, url: str, protocol: str = "grpc", timeout: float = 120.0):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.protocol, self.timeout = protocol, timeout
        self.host, self.port = _host_port(url, 8001 if protocol == "grpc" else 8000)

    def add(self, name: str, audio: np.ndarray, sample_rate: int, text: str = "") -> dict:
        """Encode ``audio`` on the server and store it as ``name`` (replacing a voice of that name)."""
        return self._call("add", name=name, audio=audio, sample_rate=sample_rate, text=text)

    def list(self) -> list[dict]:
        return self._call("list")

    def remove(self, name: str) -> dict:
        return self._call("remove", name=name)

    def _call(self, action, name=None, audio=None, sample_rate=None, text=None):
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
            from tritonclient.utils import InferenceServerException
        else:
            import tritonclient.http as tc
            from tritonclient.utils import InferenceServerException
        fields = [("ACTION", np.array([action.encode()], np.object_), "BYTES")]
        if name is not None:
            fields.append(("NAME", np.array([name.encode()], np.object_), "BYTES"))
        if audio is not None:
            fields.append(("REF_AUDIO", np.asarray(audio, np.float32).reshape(-1), "FP32"))
            fields.append(("REF_SAMPLE_RATE", np.array([sample_rate], np.int32), "INT32"))
            fields.append(("REF_TEXT", np.array([(text or "").encode()], np.object_), "BYTES"))
        inputs = []
        for n, arr, dt in fields:
            t = tc.InferInput(n, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        kw = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        client = (tc.InferenceServerClient(f"{self.host}:{self.port}") if self.protocol == "grpc"
                  else tc.InferenceServerClient(f"{self.host}:{self.port}", network_timeout=self.timeout))  # fmt: skip
        try:
            result = client.infer("voices", inputs, **kw)
        except InferenceServerException as e:
            raise TTSError(e.message()) from None
        finally:
            client.close()
        raw = result.as_numpy("RESULT").reshape(-1)[0]
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
