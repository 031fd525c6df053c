"""What the integration tests share besides fixtures: gauges read from a server, work in parallel, the
gateway in front of a server, the inputs of a generator request that carries no voice."""

from __future__ import annotations

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


def gateway_for(server):
    """The OpenAI-compatible gateway in front of ``server``, on a free loopback port -> a context of its base URL."""
    from gateway.server import in_thread

    return in_thread(f"127.0.0.1:{server.ports.grpc}")
