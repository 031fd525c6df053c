"""What the generator model keeps between executes, Triton's request objects aside.

:class:`GeneratorHost` holds the model's :class:`~engine.streams.GeneratorService` (and so its
:class:`~engine.scheduler.Scheduler`), the side channels (cancellation marks, the vocoder's list of live
streams), the keys that seal every chunk, the metrics, and a timer thread that frees orphaned streams
between executes. ``model_repository/generator/1/model.py`` only turns requests into its calls and
its chunks into responses. One lock: executes, the step thread and the timer never interleave.

Asynchronous steps (vLLM v1's async scheduling, within what Triton 2.51's Python backend allows): an
execute hands its step to one engine thread (:meth:`launch`) and returns, its requests released with
RESCHEDULE, so that Triton's own work per request (release, reschedule, the next batch's input copies
and request objects: 25 ms of every step at 256 streams, against 2 ms in our execute) overlaps the
step instead of following it. The backend reads the release flags when ``execute`` returns and a
response must go out on a request Triton still holds, so a step's chunks wait in :attr:`outbox` and
go out with the stream's next request (:meth:`take`), in the next execute, as soon as the step is done
(:meth:`settle`); a stream that ended in that step has its request released then, after its last
response, as before.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time

from engine.protocol import Chunk, end_chunk, failure_reason
from engine.scheduler import ORPHAN_SECONDS, PAUSE_SECONDS
from serving.auth import Keys
from serving.cancel import CancelBoard
from serving.generator_metrics import GeneratorMetrics
from serving.live_streams import LiveStreams
from serving.model_options import GeneratorOptions
from serving.run_folder import start_heartbeat
from serving.triton_io import load_model

log = logging.getLogger("generator")


class GeneratorHost:
    def __init__(self, pb, opts: GeneratorOptions):
        from engine.streams import GeneratorService
        from engine.synthetic import SyntheticFireRedTTS3
        from serving.synthetic_math import announce

        start_heartbeat(opts.run_dir, "generator")
        self.model = load_model(opts, parts=("core",))
        if opts.synthetic_math:  # benchmarks only: steps without the model's math (engine.synthetic)
            self.model, self.synthetic = SyntheticFireRedTTS3(self.model), announce(pb, log, "generator")
        # kv_memory_gb 0: the default pool (slots x max_len positions)
        kv_memory_gb = opts.kv_memory_gb or None
        self.service = GeneratorService(self.model, opts.slots, opts.max_len, kv_memory_gb=kv_memory_gb,
                                        attention=opts.attention)  # fmt: skip
        self.scheduler = self.service.scheduler
        self.cancels = CancelBoard(opts.cancel_dir or None)
        self.live_streams = LiveStreams(self.cancels.dir)  # read by the vocoder
        self.live_streams.clear()
        self.keys = Keys.from_env("generator")  # never key-less
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.metrics = GeneratorMetrics(pb, self.service)
        self.async_steps = opts.async_steps
        self.outbox: dict[int, tuple[float, list[Chunk]]] = {}  # stream -> (since, chunks for its next request)
        self.engine = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generator-step")
        self.in_flight: concurrent.futures.Future | None = None
        self.mark = lambda section: None  # the step thread's sections, timed by serving.execute_profile
        threading.Thread(target=self._check_forever, name="generator-attendance", daemon=True).start()
        log.info("ready: %d slots, max_len %s", self.service.slots, opts.max_len)

    def cancel(self, stream_id: int) -> Chunk:
        """End a live stream whose client left -> its sealed last chunk."""
        self.cancels.consume(stream_id)
        return self.keys.seal(self.service.cancel(stream_id))

    def admit(self, stream_id: int, inputs: tuple) -> None:
        """Start a stream from its parsed inputs (``serving.triton_io.stream_request``), listed for the
        vocoder before its first chunk goes out (the vocoder opens listed streams only)."""
        from engine.generator import InstructInput

        if isinstance(inputs[0], InstructInput):
            self.service.admit_instruct(stream_id, *inputs)
        else:
            self.service.admit(stream_id, *inputs)
        self.live_streams.sync(self.service.live)

    def step(self, stream_ids: list[int]) -> dict[int, Chunk | None]:
        """One step -> per stream its sealed chunk or None. A failed step ends every stream in it."""
        t0 = time.perf_counter()
        try:
            out = self.service.step(stream_ids)
        except Exception as e:
            log.exception("generator step failed")
            out = {i: end_chunk(i, failure_reason(RuntimeError(f"generator step failed: {e}"))) for i in stream_ids}
            for i in stream_ids:
                self.service.drop(i)
        self.metrics.step.observe(time.perf_counter() - t0)
        return {i: None if c is None else self.keys.seal(c) for i, c in out.items()}

    def launch(self, stream_ids: list[int]) -> None:
        """Step ``stream_ids`` (their chunks go to the outbox), then :meth:`after`: on the engine thread,
        which takes :attr:`lock` once the execute lets it go; without ``async_steps``, now (the caller
        holds the lock)."""
        if self.async_steps:
            self.in_flight = self.engine.submit(self._locked_step, list(stream_ids))
        else:
            self._step_and_after(stream_ids)

    def settle(self) -> None:
        """Wait for the step in flight (call without :attr:`lock`): after it, :meth:`take` has its chunks."""
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None

    def take(self, stream_id: int) -> list[Chunk]:
        """The chunks waiting for the stream's next request (sent now), oldest first."""
        return self.outbox.pop(stream_id, (0.0, []))[1]

    def _locked_step(self, stream_ids: list[int]) -> None:
        with self.lock:
            try:
                self._step_and_after(stream_ids)
            except Exception:  # the next execute must still run: its streams are freed as orphans
                log.exception("generator step thread failed")

    def _step_and_after(self, stream_ids: list[int]) -> None:
        self.mark("start")
        out = self.step(stream_ids) if stream_ids else {}
        self.mark(f"step of {len(stream_ids)}")
        now = time.monotonic()
        for stream_id, chunk in out.items():
            if chunk is not None:
                self.outbox.setdefault(stream_id, (now, []))[1].append(chunk)
        self.after(stream_ids)  # after the step: a slow step orphans nobody
        self.mark("after")

    def after(self, present: list[int] | None) -> None:
        """After an execute that held ``present`` (None: between executes): free the streams whose requests
        stopped coming (their tts is told at once, serving.bls), update the vocoder's list and the gauges."""
        for stream_id in self.scheduler.orphans(present, time.monotonic()):
            log.warning("freed the slot of a stream Triton no longer schedules (its request was dropped)")
            self.service.drop(stream_id)
            self.cancels.mark_lost(stream_id)
        self.live_streams.sync(self.service.live)  # ended streams' grace runs out between executes too
        if present is None:  # chunks whose request Triton stopped bringing back (client gone)
            now = time.monotonic()
            for stream_id in [i for i, (t, _) in self.outbox.items() if now - t > ORPHAN_SECONDS]:
                if stream_id not in self.service.live:
                    del self.outbox[stream_id]
        self.metrics.update()

    def _check_forever(self) -> None:
        last = time.monotonic()
        for tick in itertools.count(1):
            if self.stopping.wait(1.0):
                return
            with self.lock:
                if time.monotonic() - last > PAUSE_SECONDS:  # the machine was paused: nobody was away
                    self.scheduler.resume(time.monotonic())
                self.after(None)
                if tick % 30 == 0:
                    self.scheduler.forget_deferred(time.monotonic())
            last = time.monotonic()
            if tick % 30 == 0:
                self.cancels.sweep()

    def close(self) -> None:
        self.stopping.set()
        self.settle()
        self.engine.shutdown(wait=True)
        with self.lock:
            for stream_id in list(self.service.live):
                self.service.drop(stream_id)
            self.live_streams.clear()
