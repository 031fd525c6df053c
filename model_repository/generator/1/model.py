"""generator: one batched autoregressive step per execute for every stream Triton hands us.

Triton's iterative sequence batcher queues the streams (at most ``slots`` live). An execute is settle
(the previous step ends) -> send its chunks -> decide (engine.scheduler: step, cancel, admit, wait or
refuse) -> launch this step on the engine thread and return; a stream that is not finished is
released with RESCHEDULE and comes back next step, with which its chunk from this step goes out (see
serving.generator_host: Triton's per-request work overlaps the step). Responses carry the vocoder's
inputs, sealed; a failed stream ends with a normal last response whose FINISH_REASON says why.

Only our own pipeline may call it (tts and ensemble_generator, with the internal key and random 63-bit
ids): a client that could address the sequence batcher could wedge it (a request without START on a
live id takes that candidate slot for good in Triton 2.51), so every key-less request is refused.
"""

import time

import triton_python_backend_utils as pb

from engine.protocol import Chunk, end_chunk, failure_reason
from engine.scheduler import Action
from serving.auth import Refused
from serving.execute_profile import ExecuteProfile
from serving.generator_host import GeneratorHost
from serving.model_options import GeneratorOptions
from serving.triton_io import chunk_tensors, error_response, setup_logging, stream_request

log = setup_logging("generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
START = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
RESCHEDULE = pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE


class TritonPythonModel:
    def initialize(self, args):
        self.host = GeneratorHost(pb, GeneratorOptions.read(args))
        self.profile = ExecuteProfile.from_env()  # benchmarks only: $TTS_EXECUTE_PROFILE
        if self.profile is not None:
            self.execute = self.profile.wrap(self.execute)
            self.host.mark = self.profile.engine_mark
        self.mark = self.profile.mark if self.profile is not None else lambda name: None

    def execute(self, requests):
        host, mark = self.host, self.mark
        host.settle()  # the step launched by the previous execute: its chunks are in the outbox now
        with host.lock:
            mark("settle")
            steps, marked = [], host.cancels.marked()
            mark("cancel_marks")
            for r in requests:
                stream_id, sender, start = r.correlation_id(), r.get_response_sender(), bool(r.flags() & START)
                if deliver(sender, host.take(stream_id)):  # its last chunk: released, not rescheduled
                    continue
                action = host.scheduler.decide(stream_id, start, stream_id in marked).action
                if action is Action.CANCEL:
                    send(sender, host.cancel(stream_id))
                elif action is Action.STEP or self._start(r, stream_id, start, sender):
                    steps.append((r, stream_id, sender))
            mark("requests")
            host.launch([i for _, i, _ in steps])  # async: runs once this lock is let go, while Triton reschedules
            mark("launch")
            for r, stream_id, sender in steps:  # async: back in the next execute, which sends this step's chunk
                if host.async_steps or not deliver(sender, host.take(stream_id)):
                    r.set_release_flags(RESCHEDULE)
            mark("respond")

    def _start(self, request, stream_id: int, start: bool, sender) -> bool:
        """A request that is not a live stream's next step: authenticated, then admitted if it may be."""
        try:
            given, trusted = self.host.keys.split(request.parameters())
            self.host.keys.admit(trusted, "generator")
        except (Refused, ValueError) as e:
            refuse(request, sender, e)
            return False
        decision = self.host.scheduler.admission(stream_id, start, time.monotonic())
        if decision.action is Action.WAIT:  # rescheduled, nothing sent: it comes back without START
            request.set_release_flags(RESCHEDULE)
            return False
        try:
            if decision.action is Action.REFUSE:
                raise ValueError(decision.why)
            self.host.admit(stream_id, stream_request(pb, request, self.host.model, given))
        except Exception as e:  # bad input fails this request only; it never held a slot
            if not isinstance(e, ValueError):
                log.exception("could not start a stream")
            send(sender, end_chunk(0, failure_reason(e)))
            return False
        return True

    def finalize(self):
        self.host.close()
        if self.profile is not None:
            self.profile.write()


def deliver(sender, chunks: list[Chunk]) -> bool:
    """Send a stream's waiting chunks; whether the last of them ended it."""
    for chunk in chunks:
        send(sender, chunk)
    return bool(chunks) and chunks[-1].last


def send(sender, chunk: Chunk) -> None:
    sender.send(pb.InferenceResponse(chunk_tensors(pb, chunk)), flags=FINAL if chunk.last else 0)


def refuse(request, sender, error: Exception) -> None:
    """End a request from outside the pipeline. A cancelled one is rescheduled instead of answered: Triton
    2.51 then frees its candidate slot at once (and answers CANCELLED), where a released cancelled START
    keeps the slot until max_sequence_idle."""
    if request.is_cancelled():
        request.set_release_flags(RESCHEDULE)
        return
    sender.send(error_response(pb, error), flags=FINAL)
