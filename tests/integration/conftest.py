"""A real tritonserver on free loopback ports, serving a tiny checkpoint; always stopped."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import replace

import pytest

from engine.checkpoint import make_checkpoint
from engine.config import PRESETS
from engine.repository import ServeOptions, build
from engine.triton_env import Ports, TritonServer

# The stop head of this checkpoint never fires, so an utterance lasts exactly max_patches: lengths
# are chosen by the tests and long streams exist for cancellation.
NOSTOP = replace(PRESETS["tiny"], name="tiny-nostop", stop_bias=-30.0)


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
            vocoder_idle_seconds=30,
            cancel_dir=str(work / "cancel"),
            voice_dir=str(work / "voices"),
        ),
    )
    srv = TritonServer(repo, work, Ports.free())
    with srv:
        yield srv
    print(srv.log_tail(40))


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(tts_[a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_gauges_zero(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m.get("tts_generator_active_slots") == 0 and m.get("tts_vocoder_active_streams") == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)
