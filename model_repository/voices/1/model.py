"""voices: register, list and remove named voices. Registration encodes through prompt_encoder (BLS),
which owns the store; listing and removal read the store directly."""

import json

import numpy as np
import triton_python_backend_utils as pb

from serving.triton_io import bytes_tensor, error_response, get, model_parameters, scalar, setup_logging, string
from serving.voice_store import VoiceStore, check_name

log = setup_logging("voices")


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.store = VoiceStore(params.get("voice_dir") or None, identity="", encode=None)
        self.timeout_us = int(float(params.get("bls_timeout_seconds", 120)) * 1e6)

    def _add(self, r, name):
        audio = get(pb, r, "REF_AUDIO", required=False)
        sr = scalar(pb, r, "REF_SAMPLE_RATE", 0)
        if audio is None or not sr:
            raise ValueError("add needs REF_AUDIO and REF_SAMPLE_RATE")
        text = string(pb, r, "REF_TEXT", "")
        req = pb.InferenceRequest(
            model_name="prompt_encoder", requested_output_names=["PROMPT_TEXT"], timeout=self.timeout_us,
            inputs=[pb.Tensor("REF_AUDIO", audio.reshape(1, -1).astype(np.float32)),
                    pb.Tensor("REF_SAMPLE_RATE", np.array([[sr]], np.int32)),
                    bytes_tensor(pb, "REF_TEXT", text), bytes_tensor(pb, "REGISTER_NAME", name)],
        )  # fmt: skip
        resp = req.exec()
        if resp.has_error():
            raise ValueError(resp.error().message())
        return {"name": name, "text": text, "seconds": round(audio.size / sr, 3)}

    def execute(self, requests):
        out = []
        for r in requests:
            try:
                action = string(pb, r, "ACTION", "")
                if action == "list":
                    result = [v.__dict__ for v in self.store.list()]
                elif action in ("add", "remove"):
                    name = check_name(string(pb, r, "NAME", ""))
                    if action == "add":
                        result = self._add(r, name)
                    elif self.store.remove(name):
                        result = {"name": name, "removed": True}
                    else:
                        raise ValueError(f"voice {name!r} is not registered")
                else:
                    raise ValueError(f"ACTION must be add, list or remove, got {action!r}")
                out.append(pb.InferenceResponse([bytes_tensor(pb, "RESULT", json.dumps(result), batch=False)]))
            except ValueError as e:
                out.append(error_response(pb, str(e)))
            except Exception as e:
                log.exception("voices request failed")
                out.append(error_response(pb, f"voices: {e}", invalid=False))
        return out
