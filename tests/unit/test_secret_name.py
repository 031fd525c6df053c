"""The generator's secret model name never reaches a client, and a model whose stub died answers the calls
waiting on it at once (issue 30, item 5): Triton's own messages are scrubbed and a dead stub's words
become ``unavailable:``; the launcher's ``dead.<model>`` flag ends a BLS call that would never be answered."""

from __future__ import annotations

import asyncio
import types

import pytest

from engine.lifetime import LINGERING
from engine.protocol import Unavailable
from serving.flow.side_channel import SideChannel
from serving.security.auth import Keys
from serving.stub.bls import BLS
from serving.stub.triton_io import bls_error, error_response
from serving.supervision.run_folder import DEAD, RunFlags

SECRET = Keys("ab" * 32).generator_model


class PB:
    """Enough of triton_python_backend_utils for an error response."""

    class TritonError:
        INTERNAL, UNAVAILABLE, INVALID_ARG, NOT_FOUND = range(4)

        def __init__(self, message, code=0):
            self._message, self._code = message, code

        def message(self):
            return self._message

        def code(self):
            return self._code

    class InferenceResponse:
        def __init__(self, error=None):
            self._error = error

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error


def test_the_secret_name_is_what_the_scrub_looks_for():
    assert SECRET.startswith("generator-") and SECRET != "generator"


def test_a_dead_stub_is_unavailable_and_unnamed():
    response = PB.InferenceResponse(PB.TritonError(f"Stub process '{SECRET}_0_0' is not healthy.", 0))
    error = bls_error(PB, "generator", response)
    assert isinstance(error, Unavailable) and SECRET not in str(error) and "generator" in str(error)


def test_no_error_response_carries_the_secret_name():
    for message in (f"error: generator: failed in {SECRET}", RuntimeError(f"{SECRET} exploded")):
        sent = error_response(PB, message)
        assert SECRET not in sent.error().message() and "generator" in sent.error().message()
    untagged = bls_error(PB, "generator", PB.InferenceResponse(PB.TritonError(f"odd: {SECRET}", 0)))
    assert SECRET not in str(untagged)


def test_dead_flags_are_per_model_and_cleared(tmp_path):
    launcher, flags = RunFlags(tmp_path), SideChannel(tmp_path / "marks", run_dir=tmp_path)
    assert flags.flag("dead.prompt_encoder", 0) is None
    launcher.set(DEAD + "prompt_encoder", "unavailable: prompt_encoder backend died; retry")
    assert flags.flag("dead.prompt_encoder", 0).startswith("unavailable: ") and flags.flag("dead.voices", 0) is None
    launcher.clear()
    assert flags.flag("dead.prompt_encoder", 0) is None


class CountedFlags(SideChannel):
    """The launcher's flags, counting the times a model's death was asked about (each one a look that found
    it alive)."""

    def __init__(self, folder):
        super().__init__(folder / "marks", run_dir=folder)
        self.asked: dict[str, int] = {}

    def flag(self, name, within=0.0):
        model = name.removeprefix("dead.")
        self.asked[model] = self.asked.get(model, 0) + 1
        return super().flag(name, within)


def test_a_call_waiting_on_a_dead_model_ends_at_once(tmp_path):
    flags, launcher = CountedFlags(tmp_path), RunFlags(tmp_path)
    never = asyncio.Event()

    class Request:  # an InferenceRequest whose stub died: async_exec never returns
        def __init__(self, **kw):
            pass

        async def async_exec(self, decoupled=False):
            await never.wait()

    pb = types.SimpleNamespace(InferenceRequest=Request)

    async def main():
        LINGERING.set(set())
        bls = BLS(pb, 60.0, {}, flags)
        call = asyncio.create_task(bls.call("prompt_encoder", [], ["X"]))
        for _ in range(1000):  # the call looked at the flag three times, found the model alive and went on
            if flags.asked.get("prompt_encoder", 0) >= 3 or call.done():
                break
            await asyncio.sleep(0.01)
        assert flags.asked.get("prompt_encoder", 0) >= 3 and not call.done()  # it waits while the model lives
        launcher.set(DEAD + "prompt_encoder", "unavailable: prompt_encoder backend died; retry shortly")
        with pytest.raises(Unavailable, match="prompt_encoder backend died"):
            await asyncio.wait_for(call, 10)  # well before the 60 s timeout
        never.set()

    asyncio.run(main())
