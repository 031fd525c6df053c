"""The BLS calls of an async model (``tts``, ``ensemble_generator``) to the other Triton models; the
orchestrator's interfaces over them are in :mod:`serving.stub.bls_adapters`."""

from __future__ import annotations

import asyncio
import logging
import time

from engine.lifetime import linger
from engine.protocol import Unavailable, error_kind
from serving.flow.side_channel import SideChannel
from serving.stub.cancel_watch import RETIRED
from serving.stub.triton_io import bls_error
from serving.supervision.run_folder import DEAD

log = logging.getLogger("tts")
DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"


class BLS:
    """What the three clients share: ``pb``, the timeout and the request parameters that mark a request as
    ours (:class:`serving.security.auth.Keys`)."""

    def __init__(self, pb, timeout: float, parameters: dict[str, str] | None = None,
                 channel: SideChannel | None = None):  # fmt: skip
        self.pb, self.timeout, self.parameters = pb, timeout, dict(parameters or {})
        self.channel = channel  # the launcher's dead.<model> flags: a call to a model whose stub died ends at once

    async def call(self, model: str, inputs: list, outputs: list[str], decoupled: bool = False) -> dict:
        """One request, one response; ``decoupled``: the model answers with one final response."""
        request = self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                           parameters=self.parameters, timeout=int(self.timeout * 1e6))  # fmt: skip

        async def exchange():  # this frame keeps the request alive until its response is in
            if not decoupled:
                return await request.async_exec()
            responses = await request.async_exec(decoupled=True)
            try:  # Triton returns the iterator with the first response in it: reading it does not block (T26)
                return next(responses)
            finally:
                RETIRED.retire(responses)  # held until the stub has let go of it: docs/triton.md#T18

        task, deadline = linger(exchange()), time.monotonic() + self.timeout
        while not task.done():  # left to run whatever happens here (the request must outlive its exchange)
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"{model} did not answer within {self.timeout:.0f} s")
            await asyncio.wait({task}, timeout=min(left, DEAD_POLL_SECONDS))
            # a stub that died mid-request never answers it; the launcher says so (serving.supervision.supervise)
            if not task.done() and self.channel is not None and (dead := self.channel.flag(f"{DEAD}{model}")):
                raise Unavailable(error_kind(dead)[1])
        if (error := bls_error(self.pb, model, response := task.result())) is not None:
            raise error
        return {n: self.pb.get_output_tensor_by_name(response, n).as_numpy() for n in outputs}
