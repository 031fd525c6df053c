"""More streams generate together than Triton's Python backend has threads (docs/triton.md#T28).

The backend keeps one of its 32 threads per model instance with a BLS call until the call's first
response. A piped stream's own request used to be answered only after its last chunk, so each live
stream held a thread of ``tts``'s pool for its whole life: whatever ``--slots``, the generator never had
more than about 30 streams live at once (the others' requests waited in the pool's queue), and every
other BLS call and response send of ``tts`` waited behind them. 40 slots, 40 streams at once: all 40 are
live in the generator together."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from client import TTSClient
from engine.config import PATCH_SAMPLES
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import in_parallel, serving, stops_done, wait_gauges_zero

pytestmark = pytest.mark.integration

STREAMS = 40  # past the Python backend's 32 threads
PATCHES = 24


def test_more_streams_are_live_in_the_generator_than_the_backend_has_threads(nostop_ckpt, tmp_path):
    # start_rate=0: all 40 start at once (the default window lets ~32 be between their start and their first audio);
    # step_budget_ms=0: the step budget caps the live batch when a step is slow, as on 2 cores busy with the rest of
    # the suite (36 and 38 of 40 live in two runs of make test); this test is about the backend's threads
    opts = ServeOptions(checkpoint=str(nostop_ckpt), slots=STREAMS, max_len=256, cancel_dir=str(tmp_path / "cancel"),
                        voice_dir=str(tmp_path / "voices"), run_dir=str(tmp_path), start_rate=0,
                        step_budget_ms=0)  # fmt: skip
    stops_done()  # no server of an earlier module still stopping: 40 streams must be live at once on 2 cores
    with serving(TritonServer(build(tmp_path / "model_repository", opts), tmp_path, Ports.free())) as srv:
        tts = TTSClient(f"127.0.0.1:{srv.ports.grpc}", timeout=120)
        tts.synthesize("Warm up.", parameters={"max_patches": 2})
        live, done = [], threading.Event()

        def watch():  # the generator's live streams, as its gauge says, until every stream has ended
            while not done.is_set():
                live.append(srv.metrics(("tts_generator_active_slots",)).get("tts_generator_active_slots", 0))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            got = in_parallel(lambda i: tts.synthesize(f"Stream {i}.", seed=i, parameters={"max_patches": PATCHES}),
                              STREAMS, timeout=300)  # fmt: skip
        finally:
            done.set()
            watcher.join()
        assert [got[i].size for i in range(STREAMS)] == [PATCHES * PATCH_SAMPLES] * STREAMS
        assert all(np.isfinite(got[i]).all() for i in range(STREAMS))
        assert max(live) == STREAMS, f"at most {max(live):.0f} streams were live in the generator at once"
        assert wait_gauges_zero(srv)["tts_generator_active_slots"] == 0  # and every slot came back
