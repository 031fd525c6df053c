"""The wiring that ``tts`` and ``ensemble_generator`` share, built once in each stub's ``initialize``
(docs/architecture.md, "Admission: one owner")."""

from __future__ import annotations

import os

from serving.flow.admission import Admission
from serving.flow.receipts import Receipts
from serving.flow.side_channel import SideChannel
from serving.security.auth import Keys
from serving.stub.bls import BLS
from serving.stub.bls_adapters import BLSGenerator
from serving.stub.stub_threads import WARM_EXTRA_THREADS, StubThreads
from serving.supervision.run_folder import start_heartbeat


class Entry:
    """One entry point's heartbeat, the run's key, the stub's threads, the side channel (streams' marks, the
    launcher's flags), BLS, admission and the generator pipe. ``model``: ``tts`` or ``ensemble_generator``;
    ``opts``: its options (serving.config.model_options); ``instances``: the model's processes (tts's instances:
    what is per process, its board and its share of the start window, is each one's)."""

    def __init__(self, pb, model: str, opts, start_rate: float = 0.0, instances: int = 1):
        start_heartbeat(opts.run_dir, model)
        self.keys = Keys.from_env(model)
        self.threads = StubThreads(model)
        self.threads.warm(opts.slots + WARM_EXTRA_THREADS)  # a stream's own generator request holds one
        self.channel = SideChannel(opts.cancel_dir or None, opts.run_dir)
        self.bls = BLS(pb, opts.bls_timeout_seconds, self.keys.parameters(), self.channel)
        # places (slots + max_queue, one gate for tts and tts_ensemble), generator slots (streams wait here,
        # not in Triton: docs/triton.md#T14) and this process's start window
        self.admission = Admission(self.channel.dir, model, opts.capacity, opts.slots, start_rate, share=instances)
        # slots a dead server held are nobody's (every instance clears them as it loads, before any request)
        self.admission.clear()
        reader = model if instances == 1 else f"{model}.{os.getpid()}"  # a board per process
        self.receipts = Receipts(self.channel.dir, reader)  # its pipes' receipts, its held streams (T23, T22)
        self.generator = BLSGenerator(self.bls, self.keys.generator_model, self.admission, self.receipts,
                                      self.keys.new_stream_id)  # fmt: skip

    def finalize(self) -> None:
        self.generator.pipe.close()  # the generator ends this process's pipe
        self.threads.shutdown()
