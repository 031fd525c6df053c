"""The engine-thread generator of ``bench/step_overhead.py`` (the triton vllm_backend pattern): ``execute``
parses and queues; one thread admits up to ``slots`` streams, steps them all, and sends the responses.

Not imported by the bench: it is copied into the rendered model repository as ``generator_et/1/model.py``
and runs inside Triton's Python backend stub (where ``triton_python_backend_utils`` exists)."""

import collections
import queue
import threading
import time

import triton_python_backend_utils as pb

from serving.model_options import GeneratorOptions
from serving.triton_io import chunk_tensors, load_model, stream_request

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRIC = "bench_engine_thread_step_seconds"  # step_overhead.ET_METRIC reads this histogram


class TritonPythonModel:
    def initialize(self, args):
        from engine.streams import GeneratorService

        opts = GeneratorOptions.read(args)
        self.model = load_model(opts, parts=("core",))
        self.svc = GeneratorService(self.model, opts.slots, opts.max_len)
        self.fam = pb.MetricFamily(METRIC, "engine-thread generator step", pb.MetricFamily.HISTOGRAM)
        self.hist = self.fam.Metric(buckets=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
        self.inbox = queue.Queue()
        self.running = True
        self.ids = iter(range(1 << 62))
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _parse(self, r):
        return stream_request(pb, r, self.model)

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            try:
                self.inbox.put((self._parse(r), sender))
            except Exception as e:  # noqa: BLE001 (the request's one final response carries it)
                sender.send(pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG)), flags=FINAL)
        # decoupled: nothing returned, the responses go through the senders

    def _loop(self):
        waiting, senders = collections.deque(), {}
        while self.running:
            try:
                if not senders and not waiting:
                    waiting.append(self.inbox.get(timeout=0.1))
                while True:
                    waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            while waiting and self.svc.free:
                (tokens, prompt, gp, schedule), sender = waiting.popleft()
                owner = next(self.ids)
                try:
                    self.svc.admit(owner, tokens, prompt, gp, schedule)
                    senders[owner] = sender
                except Exception as e:  # noqa: BLE001 (the request's one final response carries it)
                    error = pb.TritonError(str(e), pb.TritonError.INVALID_ARG)
                    sender.send(pb.InferenceResponse(error=error), flags=FINAL)
            if not senders:
                continue
            owners = list(senders)
            t0 = time.perf_counter()
            try:
                out = self.svc.step(owners)
            except Exception as e:  # noqa: BLE001 (every stream in the step ends with it)
                for o in owners:
                    self.svc.drop(o)
                    senders.pop(o).send(pb.InferenceResponse(error=pb.TritonError(f"step failed: {e}")), flags=FINAL)
                continue
            self.hist.observe(time.perf_counter() - t0)
            for o in owners:
                chunk = out[o]
                if chunk is not None:
                    resp = pb.InferenceResponse(chunk_tensors(pb, chunk))
                    (senders.pop(o) if chunk.last else senders[o]).send(resp, flags=FINAL if chunk.last else 0)

    def finalize(self):
        self.running = False
        self.thread.join(5)
