"""generator: one batched autoregressive step per execute for every stream Triton hands us.

Triton's iterative sequence batcher owns admission: at most ``slots`` streams are live, the rest wait
in its queue. A stream that is not finished is released with RESCHEDULE and comes back next step.
Every response carries all the vocoder's inputs; a stream that fails ends with a normal last response
whose FINISH_REASON says why (an ensemble would hang on an error response).
"""

import time

import triton_python_backend_utils as pb

from engine.orchestrator import Chunk, end_chunk, failure_reason
from serving.triton_io import chunk_tensors, load_tts, model_parameters, setup_logging, stream_request

log = setup_logging("generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def send(sender, chunk: Chunk) -> None:
    sender.send(pb.InferenceResponse(chunk_tensors(pb, chunk)), flags=FINAL if chunk.last else 0)


class TritonPythonModel:
    def initialize(self, args):
        from engine.streams import GeneratorService
        from serving.cancel import CancelBoard

        params = model_parameters(args)
        self.tts = load_tts(params, parts=("core",))
        self.service = GeneratorService(self.tts, int(params.get("slots", 8)), int(params.get("max_len", 2048)))
        self.cancels = CancelBoard(params.get("cancel_dir") or None)
        self.families = [
            pb.MetricFamily("tts_generator_active_slots", "generator slots holding a stream", pb.MetricFamily.GAUGE),
            pb.MetricFamily(
                "tts_generator_step_seconds", "wall time of one batched generator step", pb.MetricFamily.HISTOGRAM
            ),
        ]
        self.gauge = self.families[0].Metric()
        self.step_hist = self.families[1].Metric(buckets=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
        log.info("ready: %d slots, max_len %s", self.service.slots, params.get("max_len"))

    def _admit(self, request, stream_id: int) -> None:
        """Start a stream; ValueError (nothing kept) for bad input."""
        if not stream_id:
            raise ValueError("a generator stream needs a correlation id")
        if not request.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
            raise ValueError(f"stream {stream_id} is not live (a new stream must start a sequence)")
        self.service.admit(stream_id, *stream_request(pb, request, self.tts))

    def execute(self, requests):
        live = []
        for r in requests:
            stream_id, sender = r.correlation_id(), r.get_response_sender()
            if stream_id in self.service.live and r.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                # an id that is already streaming: refuse the newcomer, leave the running stream alone
                send(sender, end_chunk(0, failure_reason(ValueError(f"stream id {stream_id} is in use"))))
                continue
            if stream_id in self.service.live:
                if r.is_cancelled() or self.cancels.consume(stream_id):
                    send(sender, self.service.cancel(stream_id))
                    continue
            else:
                try:
                    self._admit(r, stream_id)
                except Exception as e:  # bad input fails this request only; it never held a slot
                    if not isinstance(e, ValueError):
                        log.exception("could not start stream %x", stream_id)
                    send(sender, end_chunk(0, failure_reason(e)))
                    continue
            live.append((r, stream_id, sender))
        if live:
            t0 = time.perf_counter()
            try:
                out = self.service.step([i for _, i, _ in live])
            except Exception as e:
                log.exception("generator step failed")
                out = {i: end_chunk(i, failure_reason(RuntimeError(f"generator step failed: {e}"))) for _, i, _ in live}
                for _, i, _ in live:
                    self.service.drop(i)
            self.step_hist.observe(time.perf_counter() - t0)
            for r, stream_id, sender in live:
                chunk = out[stream_id]
                if chunk is not None:
                    send(sender, chunk)
                if chunk is None or not chunk.last:
                    r.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        self.gauge.set(self.service.active)
        return None

    def finalize(self):
        for stream_id in list(self.service.live):
            self.service.drop(stream_id)
