"""generator: one batched autoregressive step per execute for every stream Triton hands us.

Triton's iterative sequence batcher owns admission: at most ``slots`` streams are live, the rest wait
in its queue. A stream that is not finished is released with RESCHEDULE and comes back next step.
Every response carries all the vocoder's inputs; a stream that fails ends with a normal last response
whose FINISH_REASON says why (an ensemble would hang on an error response).
"""

import dataclasses
import itertools
import threading
import time

import triton_python_backend_utils as pb

from engine.orchestrator import Chunk, end_chunk, failure_reason
from serving.auth import Keys, Refused
from serving.generator_metrics import GeneratorMetrics
from serving.supervise import start_heartbeat
from serving.triton_io import chunk_tensors, error_response, load_tts, model_parameters, setup_logging, stream_request

log = setup_logging("generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Triton may stop handing us a live stream's request: when another START takes its correlation id, or
# when the request's memory is freed under it (a tts cleanup cut short did that, dropping the streams
# batched with it too; tts now holds the request to the end). Every live stream is rescheduled into the
# very next batch, so one missing from a few batches in a row is gone: its slot is freed.
MISSED_EXECUTES, MISSED_SECONDS = 3, 0.5
ORPHAN_SECONDS = 10.0  # also without executes in between (checked by a thread)
# Without the internal key (tts_ensemble) the correlation id is the client's: it must be one nobody can
# guess. Triton numbers sequences without one 1, 2, 3, ...; anyone could START on such an id.
MIN_KEYLESS_CORRELATION_ID = 1 << 32


def send(sender, chunk: Chunk) -> None:
    sender.send(pb.InferenceResponse(chunk_tensors(pb, chunk)), flags=FINAL if chunk.last else 0)


class Attendance:
    """Which live streams the executes still have (see MISSED_EXECUTES)."""

    def __init__(self):
        self.seen: dict[int, float] = {}  # when an execute last had the stream's request
        self.missed: dict[int, int] = {}  # executes in a row without it

    def orphans(self, live: list[int], present: list[int] | None, now: float) -> list[int]:
        """After an execute with ``present`` (None: a check between executes) -> the live streams gone."""
        gone, live_set = [], set(live)
        for i in live:
            if present is not None and i in present:
                self.seen[i], self.missed[i] = now, 0
                continue
            self.seen.setdefault(i, now)
            self.missed[i] = self.missed.get(i, 0) + (present is not None)
            absent = now - self.seen[i]
            if (self.missed[i] >= MISSED_EXECUTES and absent >= MISSED_SECONDS) or absent >= ORPHAN_SECONDS:
                gone.append(i)
        for i in [i for i in self.seen if i not in live_set or i in gone]:
            del self.seen[i], self.missed[i]
        return gone


class TritonPythonModel:
    def initialize(self, args):
        from engine.streams import GeneratorService
        from serving.cancel import CancelBoard

        params = model_parameters(args)
        start_heartbeat(params, "generator")
        self.tts = load_tts(params, parts=("core",))
        self.service = GeneratorService(
            self.tts, int(params.get("slots", 8)), int(params.get("max_len", 2048)),
            kv_memory_gb=float(params.get("kv_memory_gb") or 0) or None, attention=params.get("attention") or "auto",
        )  # fmt: skip
        self.cancels = CancelBoard(params.get("cancel_dir") or None)
        self.keys = Keys.from_env(params, "generator")
        # correlation id -> the STREAM_ID this stream shows the vocoder, for streams without the internal
        # key (tts_ensemble's, whose correlation ids the client or Triton chose); see serving.auth
        self.issued: dict[int, int] = {}
        self.attendance = Attendance()
        self.deferred: dict[int, float] = {}  # new streams told to wait (see _execute) -> since when
        # orphans are also looked for between requests (none may come): one lock with execute
        self.lock, self.stopping = threading.Lock(), threading.Event()
        threading.Thread(target=self._reap_forever, name="generator-reaper", daemon=True).start()
        self.metrics = GeneratorMetrics(pb, self.service)
        log.info("ready: %d slots, max_len %s", self.service.slots, params.get("max_len"))

    def _admit(self, request, stream_id: int, start: bool) -> None:
        """Start a stream; Refused or ValueError (nothing kept) for a request we must not run."""
        given, trusted = self.keys.split(request.parameters())
        self.keys.admit(trusted, "generator")
        if not stream_id:
            raise ValueError("a generator stream needs a correlation id")
        if not start:
            raise ValueError("this stream is not live (a new stream must start a sequence)")
        if not trusted and stream_id < MIN_KEYLESS_CORRELATION_ID:
            raise ValueError("send a random 63-bit sequence id with sequence_start (ids below 2^32 are refused: "
                             "Triton numbers sequences 1, 2, 3, ..., which another client could take over)")  # fmt: skip
        self.service.admit(stream_id, *stream_request(pb, request, self.tts, given))
        if not trusted:
            self.issued[stream_id] = self.keys.new_stream_id()

    def _send(self, sender, chunk: Chunk) -> None:
        shown = self.issued.pop(chunk.stream_id, None) if chunk.last else self.issued.get(chunk.stream_id)
        send(sender, dataclasses.replace(chunk, stream_id=shown) if shown else chunk)

    def execute(self, requests):
        with self.lock:
            self._execute(requests)

    def _reap_forever(self):
        for tick in itertools.count(1):
            if self.stopping.wait(1.0):
                return
            with self.lock:
                self._reap_orphans(None)
                self.metrics.update()
            if tick % 30 == 0:
                self.cancels.sweep()
                with self.lock:  # a deferred stream whose client left never comes back
                    cutoff = time.monotonic() - 60
                    self.deferred = {i: t for i, t in self.deferred.items() if t > cutoff}

    def _execute(self, requests):
        live = []
        for r in requests:
            stream_id, sender = r.correlation_id(), r.get_response_sender()
            if stream_id in self.service.live and r.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                # an id that is already streaming: refuse the newcomer, leave the running stream alone
                send(sender, end_chunk(0, failure_reason(ValueError("this correlation id is in use"))))
                continue
            if stream_id in self.service.live:
                if r.is_cancelled() or self.cancels.consume(stream_id):
                    self._send(sender, self.service.cancel(stream_id))
                    continue
            elif not self.service.free:
                # Triton thinks a slot is free: one of ours is gone and is freed within MISSED_SECONDS.
                # Until then the new stream waits: rescheduled, nothing sent (it comes back without its
                # START flag, hence the note).
                if r.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                    self.deferred[stream_id] = time.monotonic()
                r.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                continue
            else:
                start = bool(r.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START) or stream_id in self.deferred
                self.deferred.pop(stream_id, None)
                try:
                    self._admit(r, stream_id, start)
                except Refused as e:  # not our pipeline's request: nothing was read or kept
                    sender.send(error_response(pb, str(e)), flags=FINAL)
                    continue
                except Exception as e:  # bad input fails this request only; it never held a slot
                    if not isinstance(e, ValueError):
                        log.exception("could not start a stream")
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
            self.metrics.step.observe(time.perf_counter() - t0)
            for r, stream_id, sender in live:
                chunk = out[stream_id]
                if chunk is not None:
                    self._send(sender, chunk)
                if chunk is None or not chunk.last:
                    r.set_release_flags(pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        self._reap_orphans([i for _, i, _ in live])  # after the step: a slow step orphans nobody
        self.metrics.update()

    def _reap_orphans(self, present: list[int] | None) -> None:
        for stream_id in self.attendance.orphans(list(self.service.live), present, time.monotonic()):
            log.warning("freed the slot of a stream Triton no longer schedules (its request was dropped)")
            self.service.drop(stream_id)
            self.issued.pop(stream_id, None)
            self.cancels.mark_lost(stream_id)  # its tts ends it with an error at once (serving.bls)

    def finalize(self):
        self.stopping.set()
        for stream_id in list(self.service.live):
            self.service.drop(stream_id)
