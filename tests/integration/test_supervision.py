"""Supervision by the launcher: a backend that dies (kill -9) or wedges (SIGSTOP) fails the streams in
flight with a message naming it, readiness drops, the server is back by itself with no slot or vocoder
state left; SIGTERM drains, then stops within its grace period leaving no shared memory.

One launcher serves the whole module (each incident restarts its tritonserver); the SIGTERM test ends it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from client import TTSError
from serving.supervise import find_stubs
from tests.integration.launcher import Launcher, ReadyWatch, Stream, gone, with_pid

pytestmark = pytest.mark.integration

LONG = {"max_patches": 400, "chunk_first": 1, "chunk_next": 1}  # about 8 s: still running when hit
FAIL_WITHIN, BACK_WITHIN, DRAIN = 10.0, 60.0, 3


@pytest.fixture(scope="module")
def launcher(nostop_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervised")
    with Launcher.start(nostop_ckpt, tmp, "--slots", "4", "--drain-seconds", str(DRAIN)) as ln:
        ln.wait_ready()
        yield ln
    print(ln.text())


def serving_again(launcher: Launcher, since: float) -> float:
    """Seconds from ``since`` until a new request is answered; fails after BACK_WITHIN."""
    while True:
        try:
            launcher.client(timeout=10).synthesize("Back again", seed=1, parameters={"max_patches": 4})
            return time.monotonic() - since
        except (TTSError, ConnectionError, TimeoutError):
            assert time.monotonic() - since < BACK_WITHIN, f"not serving {BACK_WITHIN:.0f} s later:\n{launcher.text()}"
            time.sleep(0.5)


def check_recovered(launcher: Launcher, model: str, since: float, watch: ReadyWatch) -> float:
    back = serving_again(launcher, since)
    assert any(code != 200 for _, code in watch.stop()), "readiness stayed 200 throughout"
    for _ in range(50):  # the request above has just ended
        m = launcher.metrics()
        if m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0:
            break
        time.sleep(0.1)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0, m
    assert f"[supervisor] {model}: " in launcher.text()  # the incident is logged, naming the model
    return back


@pytest.mark.parametrize(
    "model, sig",
    [
        ("generator", signal.SIGKILL),
        ("vocoder", signal.SIGKILL),
        ("tts", signal.SIGKILL),
        ("generator", signal.SIGSTOP),
    ],
    ids=["generator-killed", "vocoder-killed", "tts-killed", "generator-wedged"],
)
def test_a_failed_backend_fails_its_streams_and_the_server_comes_back(launcher, model, sig):
    stream = Stream(launcher.client(timeout=30), "A long stream to break.", LONG)
    assert stream.started.wait(30) and stream.error is None, stream.error
    pid = launcher.stubs()[model]
    watch = ReadyWatch(launcher)
    t0 = time.monotonic()
    os.kill(pid, sig)
    try:
        assert stream.done.wait(FAIL_WITHIN), f"the stream had no answer {FAIL_WITHIN:.0f} s after the {sig.name}"
        assert stream.error is not None and str(stream.error), "the stream ended without a (named) error"
        if model != "tts":  # tts's own clients see the connection drop, with no model to name
            assert model in str(stream.error), stream.error
        back = check_recovered(launcher, model, t0, watch)
        print(f"{model} {sig.name}: stream failed {stream.ended - t0:.2f} s after ({stream.error}); "
              f"serving again after {back:.1f} s")  # fmt: skip
    finally:
        watch.stop()
        if pid in find_stubs(launcher.run_dir / "model_repository"):  # the supervisor should have killed it
            with_pid(os.kill, pid, signal.SIGKILL)


def test_a_dead_prompt_encoder_fails_the_next_request_naming_it(launcher):
    ref = np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32)
    pid = launcher.stubs()["prompt_encoder"]
    watch = ReadyWatch(launcher)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        with pytest.raises(TTSError) as failed:
            launcher.client(timeout=FAIL_WITHIN).synthesize(
                "A cloned voice.", ref_audio=ref, ref_sample_rate=24000, ref_text="a reference", parameters={"max_patches": 4}
            )  # fmt: skip
        assert "prompt_encoder" in str(failed.value) and time.monotonic() - t0 < FAIL_WITHIN
        back = check_recovered(launcher, "prompt_encoder", t0, watch)
        print(f"prompt_encoder SIGKILL: request failed ({failed.value}); serving again after {back:.1f} s")
    finally:
        watch.stop()


def test_sigterm_drains_streams_then_stops_leaving_nothing(launcher):
    client = launcher.client(timeout=30)
    short = Stream(client, "Short enough to finish.", {**LONG, "max_patches": 60})
    long = Stream(client, "Too long to finish.", LONG)
    assert short.started.wait(30) and long.started.wait(30)
    server, stubs = launcher.servers(), list(launcher.stubs().values())
    t0 = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    time.sleep(0.7)  # the launcher looks every 0.5 s
    with pytest.raises(TTSError, match="shutting down"):
        client.synthesize("Too late.", parameters={"max_patches": 4})
    assert launcher.proc.wait(DRAIN + 5) == 0
    stopped = time.monotonic() - t0
    assert short.done.wait(1) and short.error is None, short.error  # finished within the drain
    assert long.done.wait(1) and long.error is not None  # cut off with an error, not left hanging
    assert gone(server + stubs, 2)
    assert not list(Path("/dev/shm").glob(f"{launcher.shm_prefix}*"))
    assert [p.name for p in launcher.run_dir.iterdir()] == ["tritonserver.log"]
    print(f"SIGTERM: launcher exited 0 after {stopped:.1f} s; the long stream got: {long.error}")
