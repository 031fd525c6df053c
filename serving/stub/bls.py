"""The BLS calls of an async model (``tts``, ``ensemble_generator``) to the other Triton models; the
orchestrator's interfaces over them are in :mod:`serving.stub.bls_adapters`."""

from __future__ import annotations

import asyncio
import time

from engine.lifetime import linger
from engine.protocol import Unavailable, error_kind
from serving.flow.side_channel import SideChannel
from serving.stub.cancel_watch import RETIRED
from serving.stub.triton_io import bls_error
from serving.supervision.run_folder import DEAD

DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"


async def first_response(request):
    """Send a decoupled BLS request -> its first response (None: it had none). Triton returns the iterator
    with it, so reading it does not block (T26); the iterator is retired (T18)."""
    responses = await request.async_exec(decoupled=True)
    try:
        return next(responses, None)
    finally:
        RETIRED.retire(responses)  # held until the stub has let go of it


class BLS:
    """``pb``, the calls' timeout, the request parameters that mark a request as ours
    (:class:`serving.security.auth.Keys`) and the launcher's ``dead.<model>`` flags (``channel``)."""

    def __init__(self, pb, timeout: float, parameters: dict[str, str], channel: SideChannel):
        self.pb, self.timeout, self.parameters, self.channel = pb, timeout, dict(parameters), channel

    async def call(self, model: str, inputs: list, outputs: list[str], decoupled: bool = False) -> dict:
        """One request, one response; ``decoupled``: the model answers with one final response."""
        request = self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                           parameters=self.parameters, timeout=int(self.timeout * 1e6))  # fmt: skip

        # the task keeps the request alive until its response is in
        exchange = first_response(request) if decoupled else request.async_exec()
        task, deadline = linger(exchange), time.monotonic() + self.timeout
        while not task.done():  # left to run whatever happens here (the request must outlive its exchange)
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"{model} did not answer within {self.timeout:.0f} s")
            await asyncio.wait({task}, timeout=min(left, DEAD_POLL_SECONDS))
            # a stub that died mid-request never answers it; the launcher says so (serving.supervision.supervise)
            if not task.done() and (dead := self.channel.flag(f"{DEAD}{model}")):
                raise Unavailable(error_kind(dead)[1])
        if (error := bls_error(self.pb, model, response := task.result())) is not None:
            raise error
        return {n: self.pb.get_output_tensor_by_name(response, n).as_numpy() for n in outputs}
