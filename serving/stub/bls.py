"""The BLS transport of an async model (``tts``, ``ensemble_generator``): calls and streams to the other
Triton models, and the watch over a running request (its client, the launcher's flags: :func:`watch_request`).

``pb`` is ``triton_python_backend_utils``, passed in because it only exists inside the stub. Every call
has a timeout whose error names the model. The generator's streams are read on their pipe's own thread
(serving.stub.pipe_reader). The orchestrator's interfaces over this transport are in
:mod:`serving.stub.bls_adapters`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.lifetime import linger, watch
from engine.protocol import Unavailable, error_kind
from serving.flow.side_channel import SideChannel
from serving.stub.cancel_watch import CANCELS
from serving.stub.retired_iterators import RETIRED
from serving.stub.triton_io import bls_error
from serving.supervision.run_folder import BROKEN, DEAD

log = logging.getLogger("tts")
DEAD_POLL_SECONDS = 0.2  # a call waiting on a model asks this often whether its stub died
LOST = "the generator lost this stream: its responses could not be sent; retry"


async def watch_request(task: asyncio.Task, request, channel: SideChannel, lingering: set,
                        stop: Callable[[], bool] | None = None) -> str | None:  # fmt: skip
    """:func:`engine.lifetime.watch` for a Triton ``request`` served by ``task``: its client's leaving is
    ``request.is_cancelled()``, asked on the stub's watch thread (:data:`serving.stub.cancel_watch.CANCELS`,
    through :data:`RETIRED`: docs/triton.md#T18), the server's breaking the launcher's ``broken`` flag
    (:meth:`SideChannel.flag`, one read per interval for all requests). The caller sends the final response
    after this returns: after the last ``is_cancelled()`` (docs/triton.md#T3) and the cleanup, whose BLS
    requests must outlive their tasks (docs/triton.md#T4). ``stop()`` true ends the task as a client's leaving
    does (a paced request held past its bound: serving.flow.pacing)."""
    entry = CANCELS.add(request)
    broken = None
    left = (lambda: entry.cancelled) if stop is None else (lambda: entry.cancelled or stop())
    try:
        broken = await watch(task, left, lambda: channel.flag(BROKEN), lingering)
    finally:  # the iterators this request's streams left (T18) are let go by the watch's last call
        await CANCELS.remove(entry, last=broken is None)
    return broken


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
