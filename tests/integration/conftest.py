"""A real tritonserver on free loopback ports, serving a tiny checkpoint; always stopped."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.config import nostop
from engine.random_checkpoint import make_checkpoint
from serving.repository import ServeOptions, build
from serving.triton_env import Ports, TritonServer

# The stop head of this checkpoint never fires, so an utterance lasts exactly max_patches: lengths
# are chosen by the tests and long streams exist for cancellation.
NOSTOP = nostop("tiny")


@pytest.fixture(scope="session")
def nostop_ckpt(tmp_path_factory):
    return make_checkpoint(NOSTOP, tmp_path_factory.mktemp("ckpt") / "nostop", seed=0)


@pytest.fixture(scope="session")
def server(nostop_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("triton")
    repo = build(
        work / "model_repository",
        ServeOptions(
            checkpoint=str(nostop_ckpt),
            slots=4,
            max_len=1024,
            vocoder_idle_seconds=10,  # a cancelled tts_ensemble stream is reclaimed after this
            cancel_dir=str(work / "cancel"),
            voice_dir=str(work / "voices"),
            run_dir=str(work),  # heartbeats: stubs exit with their tritonserver (no supervisor here)
        ),
    )
    srv = TritonServer(repo, work, Ports.free())
    with srv:
        yield srv
    print(srv.log_tail(40))


def metrics(server) -> dict[str, float]:
    return server.metrics()


def wait_gauges_zero(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m.get("tts_generator_active_slots") == 0 and m.get("tts_vocoder_active_streams") == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def in_parallel(fn, n: int, timeout: float = 120.0) -> dict:
    """``fn(i)`` for i in 0..n-1, each on its own thread -> {i: result}; the first error is raised."""
    results, errors = {}, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def gateway_for(server):
    """The OpenAI-compatible gateway in front of ``server``, on a free loopback port -> its base URL."""
    import uvicorn

    from gateway.server import uvicorn_config
    from serving.triton_env import free_port

    port = free_port()  # the options of `python -m gateway` (the launcher's), at their defaults
    uv = uvicorn.Server(uvicorn_config(f"127.0.0.1:{server.ports.grpc}", "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)
