"""generator: one batched autoregressive step per execute for every stream Triton hands us.

Triton's iterative sequence batcher owns admission: at most ``slots`` streams are live, the rest wait
in its queue. A stream that is not finished is released with RESCHEDULE and comes back next step.
Every response carries all the vocoder's inputs, sealed (serving.auth); a stream that fails ends with
a normal last response whose FINISH_REASON says why.

Only our own pipeline may call it (tts and ensemble_generator, with the internal key and random 63-bit
correlation ids): a client that can address the sequence batcher can wedge it (a request without
START on a live sequence's id takes that candidate slot for good in Triton 2.51), so every key-less
request is refused.
"""

import itertools
import threading
import time

import triton_python_backend_utils as pb

from engine.orchestrator import Chunk, end_chunk, failure_reason
from serving.attendance import PAUSE_SECONDS, Attendance
from serving.auth import Keys, Refused
from serving.generator_metrics import GeneratorMetrics
from serving.model_options import GeneratorOptions
from serving.supervise import start_heartbeat
from serving.triton_io import chunk_tensors, error_response, load_tts, setup_logging, stream_request

log = setup_logging("generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
START = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
RESCHEDULE = pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
class TritonPythonModel:
    def initialize(self, args):
        from engine.streams import GeneratorService
        from serving.cancel import CancelBoard
        from serving.live_streams import LiveStreams

        opts = GeneratorOptions.read(args)
        start_heartbeat(opts.run_dir, "generator")
        self.tts = load_tts(opts, parts=("core",))
        # kv_memory_gb 0: the default pool (slots x max_len positions)
        self.service = GeneratorService(self.tts, opts.slots, opts.max_len, kv_memory_gb=opts.kv_memory_gb or None,
                                        attention=opts.attention)  # fmt: skip
        self.cancels = CancelBoard(opts.cancel_dir or None)
        self.live_streams = LiveStreams(self.cancels.dir)  # read by the vocoder
        self.live_streams.clear()
        self.keys = Keys.from_env("generator")  # never key-less
        self.attendance = Attendance()
        self.deferred: dict[int, float] = {}  # new streams told to wait (see _execute) -> since when
        # orphans are also looked for between requests (none may come): one lock with execute
        self.lock, self.stopping = threading.Lock(), threading.Event()
        threading.Thread(target=self._reap_forever, name="generator-reaper", daemon=True).start()
        self.metrics = GeneratorMetrics(pb, self.service)
        log.info("ready: %d slots, max_len %s", self.service.slots, opts.max_len)

    def _admit(self, request, stream_id: int, given: dict) -> None:
        """Start a stream; ValueError (nothing kept) for a request we must not run."""
        if not stream_id:
            raise ValueError("a generator stream needs a correlation id")
        self.service.admit(stream_id, *stream_request(pb, request, self.tts, given))

    def execute(self, requests):
        with self.lock:
            self._execute(requests)

    def _reap_forever(self):
        last = time.monotonic()
        for tick in itertools.count(1):
            if self.stopping.wait(1.0):
                return
            with self.lock:
                if time.monotonic() - last > PAUSE_SECONDS:  # the machine was paused: nobody was away
                    self.attendance.restart(time.monotonic())
                self._reap_orphans(None)
                self.metrics.update()
            last = time.monotonic()
            if tick % 30 == 0:
                self.cancels.sweep()
                with self.lock:  # a deferred stream whose client left never comes back
                    cutoff = time.monotonic() - 60
                    self.deferred = {i: t for i, t in self.deferred.items() if t > cutoff}

    def _execute(self, requests):
        live, marked, admitted = [], self.cancels.marked(), False
        for r in requests:
            stream_id, sender, start = r.correlation_id(), r.get_response_sender(), bool(r.flags() & START)
            if stream_id in self.service.live and not start:
                if stream_id in marked and self.cancels.consume(stream_id):
                    send(sender, self.keys.seal(self.service.cancel(stream_id)))
                    continue
                live.append((r, stream_id, sender))
                continue
            try:
                given, trusted = self.keys.split(r.parameters())
                self.keys.admit(trusted, "generator")
            except (Refused, ValueError) as e:
                refuse(r, sender, e)
                continue
            if stream_id in self.service.live:  # a START on a live id: refuse it, leave the stream alone
                send(sender, end_chunk(0, failure_reason(ValueError("this correlation id is in use"))))
                continue
            if not self.service.free:
                # Triton thinks a slot is free: one of ours is gone and is freed within MISSED_SECONDS.
                # Until then the new stream waits: rescheduled, nothing sent (it comes back without its
                # START flag, hence the note).
                if start:
                    self.deferred[stream_id] = time.monotonic()
                r.set_release_flags(RESCHEDULE)
                continue
            if not (start or self.deferred.pop(stream_id, None)):
                send(sender, end_chunk(0, failure_reason(ValueError("this stream is not live (a new stream must "
                                                                    "start a sequence)"))))  # fmt: skip
                continue
            try:
                self._admit(r, stream_id, given)
            except Exception as e:  # bad input fails this request only; it never held a slot
                if not isinstance(e, ValueError):
                    log.exception("could not start a stream")
                send(sender, end_chunk(0, failure_reason(e)))
                continue
            admitted = True
            live.append((r, stream_id, sender))
        if admitted:  # listed before their first chunk goes out: the vocoder opens only listed streams
            self.live_streams.sync(self.service.live)
        if live:
            t0 = time.perf_counter()
            try:
                out = self.service.step([i for _, i, _ in live])
            except Exception as e:
                log.exception("generator step failed")
                out = {i: end_chunk(i, failure_reason(RuntimeError(f"generator step failed: {e}"))) for _, i, _ in live}
                for _, i, _ in live:
                    self.service.drop(i)
            self.metrics.step.observe(time.perf_counter() - t0)
            for r, stream_id, sender in live:
                chunk = out[stream_id]
                if chunk is not None:
                    send(sender, self.keys.seal(chunk))
                if chunk is None or not chunk.last:
                    r.set_release_flags(RESCHEDULE)
        self._reap_orphans([i for _, i, _ in live])  # after the step: a slow step orphans nobody
        self.live_streams.sync(self.service.live)
        self.metrics.update()

    def _reap_orphans(self, present: list[int] | None) -> None:
        for stream_id in self.attendance.orphans(list(self.service.live), present, time.monotonic()):
            log.warning("freed the slot of a stream Triton no longer schedules (its request was dropped)")
            self.service.drop(stream_id)
            self.cancels.mark_lost(stream_id)  # its tts ends it with an error at once (serving.bls)
        if present is None:
            self.live_streams.sync(self.service.live)  # ended streams' grace runs out between executes too

    def finalize(self):
        self.stopping.set()
        for stream_id in list(self.service.live):
            self.service.drop(stream_id)
        self.live_streams.clear()


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
