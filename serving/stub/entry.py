"""The wiring that ``tts`` and ``ensemble_generator`` share, built once in each stub's ``initialize``.

An entry point takes a stream in from a client and sends it on to the generator over BLS: it beats its
heartbeat, reads the launcher's flags, keeps the run's internal key, serves on the stub's threads
(serving.stub.stub_threads), admits through the one owner of the limits (serving.flow.admission), reads its
generator streams on its own pipe with read receipts (serving.stub.bls_adapters, serving.flow.receipts), and
watches each request for its client's leaving or the server's breaking (serving.stub.bls.watch_request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

from engine.lifetime import LINGERING
from serving.flow.admission import Admission
from serving.flow.receipts import Receipts
from serving.flow.side_channel import SideChannel
from serving.security.auth import Keys
from serving.stub.bls import BLS, watch_request
from serving.stub.bls_adapters import BLSGenerator
from serving.stub.stub_threads import WARM_EXTRA_THREADS, Responses, StubThreads
from serving.supervision.run_folder import start_heartbeat


class Entry:
    """One entry point's collaborators. ``model``: ``tts`` or ``ensemble_generator``; ``opts``: its
    options (serving.config.model_options: run_dir, cancel_dir, bls_timeout_seconds, slots, capacity)."""

    def __init__(self, pb, model: str, opts, threads: str, start_rate: float = 0.0):
        start_heartbeat(opts.run_dir, model)
        self.keys = Keys.from_env(model)
        self.threads = StubThreads(threads)
        self.threads.warm(opts.slots + WARM_EXTRA_THREADS)  # a stream's own generator request holds one
        self.channel = SideChannel(opts.cancel_dir or None, opts.run_dir)  # streams' marks, the launcher's flags
        self.bls = BLS(pb, opts.bls_timeout_seconds, self.keys.parameters(), self.channel)
        # places (slots + max_queue, one gate for tts and tts_ensemble), generator slots (streams wait here,
        # not in Triton: docs/triton.md#T14) and this process's start window
        self.admission = Admission(self.channel.dir, model, opts.capacity, opts.slots, start_rate)
        self.admission.clear()  # one instance per model: slots a dead server held are nobody's
        self.receipts = Receipts(self.channel.dir, model)  # its pipes' receipts, its held streams (T23, T22)
        self.generator = BLSGenerator(self.bls, self.channel, self.keys.generator_model, self.admission, self.receipts,
                                      self.keys.new_stream_id)  # fmt: skip

    def responses(self, sender) -> Responses:
        """The request's sends, on the send threads: a send waits for Triton's process, the loop does not."""
        return Responses(sender, self.threads.sends)

    async def watch(self, request, run: Coroutine, stop: Callable[[], bool] | None = None):
        """Run ``run`` as the request's task until it ends, its client leaves (or ``stop()``) or the server
        breaks; (the task, the breaking's reason or None). Its streams' cleanup runs to its end first
        (engine.lifetime), so the final response may follow."""
        lingering: set = set()
        LINGERING.set(lingering)  # this task's context, and so the stream task's
        task = asyncio.ensure_future(run)
        return task, await watch_request(task, request, self.channel, lingering, stop)

    def finalize(self) -> None:
        self.generator.close()
        self.threads.shutdown()
