"""What the integration tests share besides fixtures: gauges read from a server, work in parallel, the
gateway in front of a server, the inputs of a generator request that carries no voice."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from serving.contract import LATENT_DIM

# A generator request without a voice: silent prompt latents, a zero speaker embedding.
SILENT = {"TEXT": "Direct", "PROMPT_LATENTS": np.zeros((4, LATENT_DIM), np.float32),
          "SPEAKER": np.zeros(512, np.float32), "PROMPT_TEXT": ""}  # fmt: skip


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
        except Exception as e:  # noqa: BLE001 (surfaced below)
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
