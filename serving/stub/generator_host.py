"""The generator's engine thread, Triton's request objects aside (T17, T21): docs/architecture.md, "The
generator's engine thread", "The generator pipe" and "Read receipts and pacing: the reader's board"."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol import CANCELLED, Chunk, Unavailable, end_chunk, failure_reason
from engine.step_cost import StepBudget, StepCost
from serving.config.model_options import GeneratorOptions
from serving.flow.admission import Admission
from serving.flow.receipts import ReceiptBoard
from serving.flow.side_channel import SideChannel
from serving.security.auth import Keys
from serving.stub.generator_pipes import PipeOpening, Pipes
from serving.stub.metric_batch import GeneratorMetrics, announce
from serving.stub.triton_io import load_model
from serving.supervision.run_folder import start_heartbeat

log = logging.getLogger("generator")
IDLE_WAIT_SECONDS = 0.05  # with nothing to step, the engine waits this long for an arrival (and checks marks)
SWEEP_EVERY_SECONDS = 30.0  # stale cancellation marks are swept this often
RECEIPT_POLL_SECONDS = 0.002  # with nothing to step but chunks waiting for receipts, looked at this often


@dataclass
class Arrival:  # a new stream, parsed by execute; the engine thread admits it when a slot is free
    stream_id: int  # the request's correlation id (63 random bits from tts or ensemble_generator)
    inputs: tuple  # serving.intake.request_inputs.stream_request's parse of its tensors and parameters
    sender: object  # its own request's response sender: the empty final at admission, or a refusal
    pipe: int  # the pipe its chunks go on (serving.stub.chunk_pipe)


class GeneratorHost:
    """The generator's streams and the thread that steps them. ``send(sender, chunks, final)``, its one way to send
    (a pipe's responses, and a stream's own request's refusal), sends ``chunks`` packed (serving.stub.chunk_pipe) as
    one response (none: without tensors, a pipe's opening), or only the FINAL flag when ``chunks`` is None; it
    raises when the response cannot go out."""

    def __init__(self, pb, opts: GeneratorOptions, send: Callable[[object, list[Chunk] | None, bool], None]):
        from engine.streams import GeneratorService
        from engine.synthetic import SyntheticFireRedTTS3

        start_heartbeat(opts.run_dir, "generator")
        self.model = load_model(opts, parts=("core",))
        if opts.synthetic_math:  # benchmarks only: steps without the model's math (engine.synthetic)
            cost = StepCost.parse(opts.synthetic_step)
            self.model, self.synthetic = SyntheticFireRedTTS3(self.model, cost), announce(pb, log, "generator")
            log.warning("synthetic step: %s", cost)
        # kv_memory_gb 0: the default pool (slots x max_len positions)
        self.service = GeneratorService(self.model, opts.slots, opts.max_len, kv_memory_gb=opts.kv_memory_gb or None,
                                        attention=opts.attention, batch_invariant=opts.batch_invariant)  # fmt: skip
        self.channel = SideChannel(opts.cancel_dir or None)  # cancel marks in, lost marks and live streams out
        self.channel.live.clear()
        self.receipts = ReceiptBoard(self.channel.dir)  # the readers' boards: receipts and held streams
        # the step budget caps the senders' generator slots: streams beyond it wait there, holding no thread
        self.budget = StepBudget(opts.step_budget_ms / 1000)
        self.slot_cap = Admission(self.channel.dir, None, 1, opts.slots)  # its cap: serving.flow.admission
        self._set_cap()
        self.keys = Keys.from_env("generator")  # never key-less
        self.metrics = GeneratorMetrics(pb, self.service)
        # execute -> engine thread: streams are admitted between two steps, in arrival order
        self.arrivals: queue.SimpleQueue[Arrival | PipeOpening] = queue.SimpleQueue()
        self.waiting: deque[Arrival] = deque()  # arrived, no slot yet, oldest first (engine thread only)
        self.pipes = Pipes(send, self._lose, self.metrics.waited)
        self.stopping = threading.Event()
        self.engine = threading.Thread(target=self._run, name="generator-engine", daemon=True)
        self.engine.start()
        log.info("ready: %d slots, max_len %s", self.service.slots, opts.max_len)

    # ---- the engine thread ----
    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_EVERY_SECONDS
        while not self.stopping.is_set():
            try:
                held = self.receipts.held()  # streams whose readers' clients are far behind (serving.flow.pacing)
                idle = not self.waiting and all(i in held for i in self.service.live)  # all held: nothing to step
                unsent = self.pipes.unsent()
                self._take(wait=IDLE_WAIT_SECONDS if idle and not unsent else RECEIPT_POLL_SECONDS if idle else 0)
                self._cancel_marked()
                self._admit()
                if self.service.live:
                    self._step(held)
                if self.pipes.open:
                    self.pipes.flush()
                self.channel.live.sync(self.service.live)  # ended streams' grace runs out between steps too
                self.metrics.update(unsent)
                if time.monotonic() >= next_sweep:
                    self.channel.sweep()
                    next_sweep = time.monotonic() + SWEEP_EVERY_SECONDS
            except Exception:  # never let the thread die: every live stream would wait forever
                log.exception("generator engine iteration failed")
                time.sleep(IDLE_WAIT_SECONDS)

    def _take(self, wait: float) -> None:
        """Move what ``execute`` queued to :attr:`waiting` (waiting up to ``wait`` seconds for it); one
        that names a live stream is refused at once, and the live stream is left alone."""
        with contextlib.suppress(queue.Empty):
            if wait:
                self._arrived(self.arrivals.get(timeout=wait))
            while True:
                self._arrived(self.arrivals.get_nowait())

    def _arrived(self, a: Arrival | PipeOpening) -> None:
        if isinstance(a, PipeOpening):
            self.pipes.start(a)
        elif a.stream_id in self.service.live or a.stream_id in self.pipes.riding:
            self._answer(a.sender, end_chunk(0, failure_reason(ValueError("this correlation id is in use"))))
        else:
            self.waiting.append(a)

    def _cancel_marked(self) -> None:
        """End the streams whose callers asked to (live or waiting for a slot), each with its cancelled last chunk."""
        marked = self.channel.poll()["cancel"]  # one listing per step
        if not marked:
            return
        for pipe_id in [i for i in self.pipes.open if i in marked]:  # its reader closed it
            self.channel.take("cancel", pipe_id)
            self.pipes.end(pipe_id, "its reader closed it")
        for stream_id in [i for i in self.service.live if i in marked]:
            self.channel.take("cancel", stream_id)
            self.pipes.post(self.keys.seal(self.service.cancel(stream_id)))
        if any(a.stream_id in marked for a in self.waiting):
            kept = deque()
            for a in self.waiting:
                if a.stream_id in marked and a.stream_id not in self.service.live:
                    self.channel.take("cancel", a.stream_id)
                    self._answer(a.sender, self.keys.seal(end_chunk(a.stream_id, CANCELLED)))
                else:
                    kept.append(a)
            self.waiting = kept

    def _admit(self) -> None:
        """Admit waiting streams in arrival order while slots are free, then list them for the vocoder
        (which opens listed streams only) before their first chunk goes out."""
        from engine.generator import InstructInput

        admitted = False
        while self.waiting and self.service.free:
            a = self.waiting.popleft()
            try:
                if why := self.service.scheduler.refusal(a.stream_id):  # no id, or a live stream's (left alone)
                    raise ValueError(why)
                if a.pipe not in self.pipes.open:
                    raise Unavailable(
                        f"the generator has no pipe {a.pipe:x} (closed, or the generator restarted); retry"
                    )
                admit = self.service.admit_instruct if isinstance(a.inputs[0], InstructInput) else self.service.admit
                admit(a.stream_id, *a.inputs)
            except Exception as e:  # bad input fails this request only; it never held a slot
                if not isinstance(e, ValueError | Unavailable):
                    log.exception("could not start a stream")
                self._answer(a.sender, end_chunk(0, failure_reason(e)))
                continue
            self.pipes.add(a.pipe, a.stream_id)  # its chunks, the last included, go on the pipe
            # its own request is answered now (T28); a caller that is gone: its pipe's reader drops its chunks
            self.pipes.safely(a.sender, None, True)
            admitted = True
        if admitted:
            self.channel.live.sync(self.service.live)

    def _step(self, held: set[int]) -> None:
        """One step of every live stream but the ``held`` ones (their clients are far behind: serving.flow.pacing;
        they keep their slots); each chunk that is due, sealed, waits for its pipe's next response. A failed
        step ends every stream in it."""
        run = [i for i in self.service.live if i not in held]
        t0 = time.perf_counter()
        try:
            out = self.service.step(run)  # all held (run empty): their chunk clocks rest all the same
        except Exception as e:
            log.exception("generator step failed")
            out = {i: end_chunk(i, failure_reason(RuntimeError(f"generator step failed: {e}"))) for i in run}
            for i in run:
                self.service.drop(i)
        if run:
            took = time.perf_counter() - t0
            self.metrics.stepped(took, len(run))
            self.budget.stepped(took, len(run))
            self._set_cap()
        for chunk in out.values():
            if chunk is not None:
                self.pipes.post(self.keys.seal(chunk))

    def _set_cap(self) -> None:
        """Cap the senders' generator slots at the live streams plus the step budget's room (0: no cap)."""
        room = self.budget.room(len(self.service.live))
        self.slot_cap.set_cap(0 if room is None else len(self.service.live) + room)  # 8 bytes in the shared file

    def _answer(self, sender, chunk: Chunk) -> None:  # a stream's own request ends: refused, or cancelled waiting
        self.pipes.safely(sender, [chunk], True)

    def _lose(self, stream_ids: set[int]) -> None:
        """End the streams of a pipe that ended: dropped and marked lost (their reader hears of it:
        serving.stub.pipe_reader; their own requests were answered when they were admitted)."""
        for stream_id in stream_ids:
            self.service.drop(stream_id)
            self.channel.mark("lost", stream_id)

    def close(self) -> None:
        """Stop the engine thread, then end every stream it held or had not admitted yet."""
        self.stopping.set()
        self.engine.join(30)
        self._take(wait=0)
        bye = failure_reason(Unavailable("the generator is shutting down; retry"))
        for stream_id in list(self.service.live):
            self.service.drop(stream_id)
            self.pipes.post(self.keys.seal(end_chunk(stream_id, bye)))
        self.pipes.flush(paced=False)  # unpaced now: every stream gets its last chunk
        for pipe_id in list(self.pipes.open):
            self.pipes.end(pipe_id, "the generator is shutting down")
        for a in self.waiting:
            self._answer(a.sender, end_chunk(a.stream_id, bye))
        self.waiting.clear()
        self.channel.live.clear()
