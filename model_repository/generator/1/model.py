"""generator: one batched autoregressive step per execute for every stream Triton hands us.

Triton's iterative sequence batcher owns admission: at most ``slots`` streams are live, the rest wait
in its queue. A stream that is not finished is released with RESCHEDULE and comes back next step.
"""

import time

import numpy as np
import triton_python_backend_utils as pb

from engine.generator import GenerationParams
from engine.prompt import VoicePrompt
from engine.triton_model import bytes_tensor, get, load_tts, model_parameters, scalar, setup_logging

log = setup_logging("generator")


class TritonPythonModel:
    def initialize(self, args):
        import torch

        from engine.cancel import CancelBoard
        from engine.service import GeneratorService

        params = model_parameters(args)
        self.tts = load_tts(params, parts=("core",))
        self.svc = GeneratorService(self.tts, int(params.get("slots", 8)), int(params.get("max_len", 2048)))
        self.torch = torch
        self.cancels = CancelBoard(params.get("cancel_dir") or None)
        self.families = [
            pb.MetricFamily("tts_generator_active_slots", "generator slots holding a stream", pb.MetricFamily.GAUGE)
        ]
        self.families.append(
            pb.MetricFamily(
                "tts_generator_step_seconds", "wall time of one batched generator step", pb.MetricFamily.HISTOGRAM
            )
        )
        self.gauge = self.families[0].Metric()
        self.step_hist = self.families[1].Metric(buckets=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
        log.info("ready: %d slots, max_len %s", self.svc.table.size, params.get("max_len"))

    def _admit(self, request, owner):
        tokens = get(pb, request, "TOKENS").reshape(-1).astype(np.int64).tolist()
        latents = get(pb, request, "PROMPT_LATENTS").reshape(-1, 64)
        speaker = get(pb, request, "SPEAKER").reshape(-1)
        prompt = VoicePrompt(self.torch.from_numpy(latents.copy()), self.torch.from_numpy(speaker.copy()), "")
        gp = GenerationParams(
            seed=int(scalar(pb, request, "SEED")), steps=int(scalar(pb, request, "STEPS")),
            cfg=float(scalar(pb, request, "CFG")), max_patches=int(scalar(pb, request, "MAX_PATCHES")),
        )  # fmt: skip
        schedule = (int(scalar(pb, request, "CHUNK_FIRST")), int(scalar(pb, request, "CHUNK_NEXT")))
        self.svc.admit(owner, tokens, prompt, gp, schedule)

    def execute(self, requests):
        live = []
        for r in requests:
            owner = r.correlation_id()
            sender = r.get_response_sender()
            if r.is_cancelled() or self.cancels.is_marked(owner):
                self.svc.drop(owner)
                self.cancels.clear(owner)
                # a plain final response: an error response with code CANCELLED never reached the BLS caller
                done = pb.InferenceResponse([bytes_tensor(pb, "FINISH_REASON", "cancelled")])
                sender.send(done, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            if owner not in self.svc.live:
                try:
                    self._admit(r, owner)
                except Exception as e:  # bad input fails this request only
                    sender.send(pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG)),
                                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip
                    continue
            live.append((r, owner, sender))
        if live:
            t0 = time.perf_counter()
            try:
                out = self.svc.step([o for _, o, _ in live])
            except Exception as e:
                log.exception("generator step failed")
                for _r, owner, sender in live:
                    self.svc.drop(owner)
                    sender.send(pb.InferenceResponse(error=pb.TritonError(f"generator step failed: {e}")),
                                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip
                live, out = [], {}
            self.step_hist.observe(time.perf_counter() - t0)
            for r, owner, sender in live:
                em = out[owner]
                outputs = []
                if em.latents is not None:
                    outputs.append(pb.Tensor("LATENTS", em.latents[None].astype(np.float32)))
                if em.finished:
                    outputs.append(bytes_tensor(pb, "FINISH_REASON", em.reason))
                    sender.send(pb.InferenceResponse(outputs), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    if outputs:
                        sender.send(pb.InferenceResponse(outputs))
                    r.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        self.gauge.set(self.svc.active)
        return None

    def finalize(self):
        for owner in list(self.svc.live):
            self.svc.drop(owner)
