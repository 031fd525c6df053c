"""A real tritonserver on free loopback ports, serving a tiny checkpoint; always stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import nostop
from engine.random_checkpoint import make_checkpoint
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import (
    GRPC_FRONT_LIMITS,
    HTTP_FRONT_LIMITS,
    STOP_ERRORS,
    behind_fronts,
    gateway_for,
    serving,
    stops_done,
)

# The stop head of this checkpoint never fires, so an utterance lasts exactly max_patches: lengths
# are chosen by the tests and long streams exist for cancellation.
NOSTOP = nostop("tiny")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a launcher (tests/integration/launcher.py) reports the end of the launcher's
    output: what its supervisor saw and did (a restart, a stale heartbeat) is why most such failures happen,
    and its run folder is gone with the test run."""
    outcome = yield
    report = outcome.get_result()
    launcher = getattr(item, "funcargs", {}).get("launcher")
    if report.failed and launcher is not None and hasattr(launcher, "text"):
        try:
            report.sections.append(("launcher output (last 6,000 characters)", launcher.text()[-6000:]))
        except OSError as e:
            report.sections.append(("launcher output", f"unreadable: {e}"))


@pytest.fixture(scope="session", autouse=True)
def _stops_joined():
    """Every server that ``helpers.serving`` stops on a thread has stopped, and passed its check, before the
    session ends (set up first, so torn down last)."""
    yield
    stops_done()
    if STOP_ERRORS:
        raise STOP_ERRORS[0]


@pytest.fixture(scope="session")
def nostop_ckpt(tmp_path_factory):
    return make_checkpoint(NOSTOP, tmp_path_factory.mktemp("ckpt") / "nostop", seed=0)


@pytest.fixture(scope="session")
def server_options(nostop_ckpt, tmp_path_factory) -> ServeOptions:
    """The options of the session's ``server`` (a test may start a server like it, on its voice folder)."""
    work = tmp_path_factory.mktemp("triton")
    return ServeOptions(
        checkpoint=str(nostop_ckpt),
        slots=4,
        max_len=1024,
        vocoder_idle_seconds=10,  # a cancelled tts_ensemble stream is reclaimed after this
        cancel_dir=str(work / "cancel"),
        voice_dir=str(work / "voices"),
        run_dir=str(work),  # heartbeats: stubs exit with their tritonserver (no supervisor here)
        pace_hold_seconds=4.0,  # a paced request held out ends within seconds (test_pacing_server)
    )


@pytest.fixture(scope="session")
def server(server_options):
    """Stopped on a thread at the session's end, beside the other servers still stopping then."""
    work = Path(server_options.run_dir)
    repo = build(work / "model_repository", server_options)
    with serving(TritonServer(repo, work, Ports.free()), then=lambda srv: print(srv.log_tail(40))) as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway(server):
    """The OpenAI-compatible gateway in front of the module's ``server`` (a module may serve its own)."""
    with gateway_for(server) as url:
        yield url


@pytest.fixture(scope="session")
def fronted(nostop_ckpt, tmp_path_factory):
    """A server behind both bounded fronts, without tts_ensemble (2 slots, 2 waiting): test_grpc_front's,
    test_http_front's and test_hardening's sealed server (one start for the three)."""
    with behind_fronts(nostop_ckpt, tmp_path_factory.mktemp("fronts"), grpc_front=GRPC_FRONT_LIMITS,
                       http_front=HTTP_FRONT_LIMITS, ensemble=False) as srv:  # fmt: skip
        yield srv
