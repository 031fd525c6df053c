"""asyncio streaming over gRPC (``tritonclient.grpc.aio``): many streams share one channel.

    async with AsyncTTSClient("127.0.0.1:8001") as tts:
        async for chunk in tts.stream("Hello", seed=1):
            ...

Leaving the ``async for`` early (or cancelling the task) cancels the request on the server.
Errors and timeouts are those of :class:`client.TTSClient`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from client.request import (
    edit_task,
    grpc_error,
    grpc_inputs,
    is_final,
    plan_text,
    raise_if_failed,
    request_fields,
)
from client.tts_client import Chunk, _host_port


class AsyncTTSClient:
    """Args as :class:`client.TTSClient` (gRPC only). The channel is opened on first use, in the running
    event loop; :meth:`close` it (or use ``async with``)."""

    def __init__(self, url: str, timeout: float = 60.0, model: str = "tts", stream_timeout: float | None = None):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        host, port = _host_port(url, 8001)
        self.url, self.timeout, self.model = f"{host}:{port}", timeout, model
        self.stream_timeout = stream_timeout or 10 * timeout
        self._client = None

    async def __aenter__(self) -> AsyncTTSClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    def _channel(self):
        if self._client is None:
            from tritonclient.grpc import aio

            self._client = aio.InferenceServerClient(self.url)
        return self._client

    async def stream(
        self,
        text: str | None,
        language: str | None = None,
        ref_audio: np.ndarray | None = None,
        ref_sample_rate: int | None = None,
        ref_text: str | None = None,
        voice_id: str | None = None,
        seed: int | None = None,
        parameters: dict | None = None,
        instruction: str | None = None,
        task: str | None = None,
        on_plan: Callable[[str], None] | None = None,
    ) -> AsyncIterator[Chunk]:
        """Chunks as the server sends them (see :meth:`client.TTSClient.stream`: ``on_plan`` gets the plan
        text before the first chunk)."""
        import grpc  # here, not at import time: `import client` stays light (and gevent-agnostic)

        fields = request_fields(text, language, ref_audio, ref_sample_rate, ref_text, voice_id, seed, instruction,
                                task)  # fmt: skip
        request = {
            "model_name": self.model,
            "inputs": grpc_inputs(fields, model=self.model),
            "parameters": parameters or {},
        }

        async def one_request():
            # then the request side half-closes: the server ends the stream after the request's final
            # response (the aio client cannot ask for Triton's empty final response, so that is the end marker)
            yield request

        t0 = time.perf_counter()
        responses = self._channel().stream_infer(one_request(), stream_timeout=self.stream_timeout)
        done = False
        try:
            while not done:
                try:
                    result, error = await asyncio.wait_for(anext(responses), self.timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no response from the server for {self.timeout:g} s") from None
                except StopAsyncIteration:
                    done = True
                    break
                except grpc.RpcError as e:
                    done = True
                    raise grpc_error(e) from None
                if error is not None:
                    done = True
                    raise grpc_error(error)
                done = is_final(result)
                raise_if_failed(result.as_numpy("FINISH_REASON"))
                if on_plan is not None and (plan := plan_text(result.as_numpy("PLAN_TEXT"))) is not None:
                    on_plan(plan)
                audio = result.as_numpy("AUDIO")
                if audio is not None and audio.size:
                    yield Chunk(audio.astype(np.float32).reshape(-1), time.perf_counter() - t0)
        finally:
            if not done:
                responses.cancel()

    def edit(self, recording: np.ndarray, sample_rate: int, instruction: str, kind: str = "semantic", **kw):
        """``recording`` edited as ``instruction`` says, streamed (see :meth:`client.TTSClient.edit`)."""
        return self.stream(None, ref_audio=recording, ref_sample_rate=sample_rate, instruction=instruction,
                           task=edit_task(kind), **kw)  # fmt: skip

    async def synthesize(self, text: str | None, **kw) -> np.ndarray:
        """The whole utterance as one array, shape (n,) float32 at 24 kHz."""
        chunks = [c.audio async for c in self.stream(text, **kw)]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
