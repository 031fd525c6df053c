"""vocoder: latent chunks -> PCM chunks with per-stream RedAE decoder state (sequence batcher).

START primes the stream's decoder with the prompt latents; END flushes the iSTFT tail and frees the
state; streams idle longer than the configured time are reclaimed.
"""

import numpy as np
import triton_python_backend_utils as pb

from engine.triton_model import error_response, get, load_tts, model_parameters, scalar, setup_logging

log = setup_logging("vocoder")


class TritonPythonModel:
    def initialize(self, args):
        from engine.service import VocoderService

        params = model_parameters(args)
        self.svc = VocoderService(load_tts(params, parts=("decoder",)), float(params.get("idle_seconds", 60)))
        self.family = pb.MetricFamily(
            "tts_vocoder_active_streams", "vocoder streams holding decoder state", pb.MetricFamily.GAUGE
        )
        self.gauge = self.family.Metric()

    def execute(self, requests):
        for owner in self.svc.reap():
            log.warning("reclaimed idle vocoder stream %s", owner)
        items, parsed = [], []  # one item per request that parsed; chunks of equal length batch together
        for r in requests:
            owner = int(scalar(pb, r, "CORRID"))
            try:
                start, end = bool(scalar(pb, r, "START", 0)), bool(scalar(pb, r, "END", 0))
                latents = get(pb, r, "LATENTS").reshape(-1, 64)
                prompt = get(pb, r, "PROMPT_LATENTS", required=False)
                items.append((owner, latents, start, end, None if prompt is None else prompt.reshape(-1, 64)))
                parsed.append(None)
            except Exception as e:
                self.svc.drop(owner)
                parsed.append(e)
        outs = iter(self.svc.process_many(items))
        responses = []
        for err in parsed:
            out = err if err is not None else next(outs)
            if isinstance(out, Exception):
                responses.append(error_response(pb, f"vocoder: {out}", invalid=isinstance(out, ValueError)))
            else:
                responses.append(pb.InferenceResponse([pb.Tensor("AUDIO", out[None].astype(np.float32))]))
        self.gauge.set(self.svc.active)
        return responses
