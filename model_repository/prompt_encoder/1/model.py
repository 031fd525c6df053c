"""prompt_encoder: reference audio + transcript -> voice prompt (latents, speaker embedding, text)."""

import numpy as np
import triton_python_backend_utils as pb

from engine.triton_model import bytes_tensor, error_response, get, load_tts, model_parameters, scalar, setup_logging, string

log = setup_logging("prompt_encoder")


class TritonPythonModel:
    def initialize(self, args):
        self.tts = load_tts(model_parameters(args))
        self.family = pb.MetricFamily("tts_prompt_encodes_total", "reference clips encoded", pb.MetricFamily.COUNTER)
        self.encodes = self.family.Metric()

    def _one(self, r):
        if string(pb, r, "VOICE_ID", "") != "":
            raise ValueError("VOICE_ID: named voices are not available on this server yet")
        audio = get(pb, r, "REF_AUDIO", required=False)
        text = string(pb, r, "REF_TEXT", "")
        if audio is None:
            if text:
                raise ValueError("REF_TEXT was given without REF_AUDIO")
            prompt = self.tts.encode_prompt(None)
        else:
            sr = scalar(pb, r, "REF_SAMPLE_RATE", 0)
            if not sr or sr < 8000 or sr > 192000:
                raise ValueError(f"REF_SAMPLE_RATE must be given with REF_AUDIO, in 8000..192000 Hz (got {sr})")
            prompt = self.tts.encode_prompt(audio.reshape(-1).astype(np.float32), int(sr), text)
            self.encodes.increment(1)
        return pb.InferenceResponse([
            pb.Tensor("PROMPT_LATENTS", prompt.latents.numpy()[None].astype(np.float32)),
            pb.Tensor("SPEAKER", prompt.speaker.numpy()[None].astype(np.float32)),
            bytes_tensor(pb, "PROMPT_TEXT", prompt.text),
        ])  # fmt: skip

    def execute(self, requests):
        out = []
        for r in requests:
            try:
                out.append(self._one(r))
            except ValueError as e:
                out.append(error_response(pb, str(e)))
            except Exception as e:
                log.exception("prompt encoding failed")
                out.append(error_response(pb, f"prompt encoding failed: {e}", invalid=False))
        return out
