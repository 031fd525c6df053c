"""asyncio streaming over gRPC (``tritonclient.grpc.aio``): many streams share one channel.

    async with AsyncTTSClient("127.0.0.1:8001") as tts:
        async for chunk in tts.stream("Hello", seed=1):
            ...

Leaving the ``async for`` early (or cancelling the task) cancels the request on the server.
Errors and timeouts are those of :class:`client.TTSClient`.

A server that is not up yet (or restarting) is reached as soon as it is: the channel retries a refused
connection every :data:`RECONNECT_MAX_MS` at most (gRPC's default backoff grows to 120 s: a gateway that
started before its server kept failing for ~17 s after the server was ready), and a request that failed
to connect drops the channel, so the next request connects afresh instead of waiting out a backoff.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Self, Unpack

import numpy as np

from client.pace import PACE, REQUEST_ID, Pace, PaceFeed, is_pace_error, next_response
from client.request import RequestSettings, TTSRequest, edit_task, grpc_error, grpc_inputs, is_final
from client.text_in import AsyncTextStream
from client.tts_client import Chunk, _host_port, chunk_of

RECONNECT_FIRST_MS = 100  # the channel's first retry of a refused connection
RECONNECT_MAX_MS = 1000  # and its longest wait between retries (gRPC's default: 120 s)


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
        self._retired: set = set()  # channels dropped after a connection failure, closing in the background

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
        for task in list(self._retired):
            await task

    def _channel(self):
        if self._client is None:
            import tritonclient.grpc as grpcclient
            from tritonclient.grpc import aio

            keepalive = grpcclient.KeepAliveOptions()
            args = [  # tritonclient's defaults (channel_args replaces them all), plus a short reconnect backoff
                ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
                ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
                ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
                # (not grpc.min_reconnect_backoff_ms: gRPC reads it as the shortest connection deadline)
                ("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
                # a channel of its own connections: gRPC shares them (and their backoff) between channels to
                # one address by default, so a new channel would wait out the old one's backoff
                ("grpc.use_local_subchannel_pool", 1),
            ]
            self._client = aio.InferenceServerClient(self.url, channel_args=args)
        return self._client

    def _unreachable(self, client) -> None:
        """``client``'s channel failed to reach the server: the next request opens a new one, which connects
        at once; the old one closes once its other streams (if any still run) end."""
        if self._client is client:
            self._client = None
            task = asyncio.get_running_loop().create_task(client._channel.close(grace=self.stream_timeout))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    async def is_ready(self) -> bool:
        """Whether the server answers and is ready; ``ConnectionError`` when nothing answers."""
        from tritonclient.utils import InferenceServerException

        client = self._channel()
        try:
            return await client.is_server_ready()
        except InferenceServerException as e:
            error = grpc_error(e)
            if isinstance(error, ConnectionError):
                self._unreachable(client)
            raise error from None

    async def stream(self, text: str | None, pace: Pace | bool | None = None,
                     **settings: Unpack[RequestSettings]) -> AsyncIterator[Chunk]:  # fmt: skip
        """Chunks as the server sends them (``settings``: as :meth:`client.TTSClient.stream`'s; ``on_plan``
        gets the plan text before the first chunk; ``speed`` is the ``speed`` parameter). ``pace``
        (:mod:`client.pace`): True paces the server by this iteration (a chunk is taken when the next one is
        asked for); a :class:`~client.pace.Pace` by what its owner counts (``pace.took``); None: unpaced."""
        import grpc  # here, not at import time: `import client` stays light (and gevent-agnostic)

        tts_request = TTSRequest.of(text, settings)
        on_plan = tts_request.on_plan
        own = pace is True
        pace = Pace() if own else pace or None
        parameters = tts_request.parameters if pace is None else {**tts_request.parameters, PACE: pace.token}
        request = {
            "model_name": self.model,
            "inputs": grpc_inputs(tts_request.fields, model=self.model),
            "parameters": parameters,
        }
        # the request, then (paced) its pace reports; then the request side half-closes: the server ends the
        # stream after the request's final response (the aio client cannot ask for Triton's empty final
        # response, so that is the end marker)
        feed = PaceFeed(self.model, pace)
        feed.put(request)
        if pace is None:
            feed.close()

        t0 = time.perf_counter()
        client = self._channel()
        responses = client.stream_infer(feed.requests(), stream_timeout=self.stream_timeout)
        done = False
        try:
            while not done:
                try:
                    result, error = await next_response(responses, pace, own, self.timeout)
                except TimeoutError:
                    raise TimeoutError(f"no response from the server for {self.timeout:g} s") from None
                except StopAsyncIteration:
                    done = True
                    break
                except grpc.RpcError as e:
                    done = True
                    raise self._failed(client, e) from None
                if error is not None:
                    if pace is not None and is_pace_error(error):  # a report's answer, not the stream's
                        continue
                    done = True
                    raise self._failed(client, error)
                if pace is not None and result.get_response().id == REQUEST_ID:
                    continue
                done = is_final(result)
                chunk = chunk_of(result, on_plan, t0)
                if chunk is not None:
                    yield chunk
                    if own:  # asked for the next one: this one was taken
                        pace.took(chunk.audio.size)
        finally:
            feed.close()
            if not done:
                responses.cancel()

    def _failed(self, client, error) -> Exception:
        exc = grpc_error(error)
        if isinstance(exc, ConnectionError):
            self._unreachable(client)
        return exc

    async def open_text(self, *, release: str | None = None, pace: Pace | bool | None = None,
                        **settings: Unpack[RequestSettings]) -> AsyncTextStream:  # fmt: skip
        """Open a text-in stream (:mod:`client.text_in`): ``await ts.send(text, flush=False)``, ``await
        ts.end()``, ``await ts.cancel()``, ``async for item in ts`` (:class:`Chunk` and :class:`Flushed`).
        ``settings``: :meth:`stream`'s; ``release``: ``sentence`` (the server's default: a segment is also
        cut at each sentence end) or ``flush`` (only at flushes and the end); ``pace``: as :meth:`stream`'s.
        The request goes out now: the server admits the stream and encodes the voice while the text is still
        being written."""
        request = TTSRequest.of(None, settings)
        fields = request.fields if release is None else {**request.fields, "RELEASE": release}
        return AsyncTextStream(self, fields, request.parameters, request.on_plan, pace)

    async def stream_text(
        self, pieces, flush: bool = False, release: str | None = None, pace: Pace | bool | None = None,
        **settings: Unpack[RequestSettings],
    ) -> AsyncIterator[Chunk]:  # fmt: skip
        """The audio of a text sent as ``pieces`` (an iterable or async iterable of str, read as they come),
        as it is made; ``flush``: flush after every piece; ``release`` and ``settings``: as :meth:`open_text`.
        Leaving early cancels the stream on the server; ``pace``: as :meth:`stream`'s."""
        text_stream = await self.open_text(release=release, pace=pace, **settings)

        async def feed():
            try:
                if hasattr(pieces, "__aiter__"):
                    async for piece in pieces:
                        await text_stream.send(piece, flush)
                else:
                    for piece in pieces:
                        await text_stream.send(piece, flush)
                        await asyncio.sleep(0)
            except BaseException:
                await text_stream.cancel()  # the iteration ends; the error is raised from here
                raise
            await text_stream.end()

        feeder = asyncio.ensure_future(feed())
        try:
            async for item in text_stream:
                if isinstance(item, Chunk):
                    yield item
            await feeder  # its error, if any
        finally:
            if not feeder.done():
                feeder.cancel()
            await text_stream.cancel()

    def edit(self, recording: np.ndarray, sample_rate: int, instruction: str, kind: str = "semantic",
             **kw: Unpack[RequestSettings]):  # fmt: skip
        """``recording`` edited as ``instruction`` says, streamed (see :meth:`client.TTSClient.edit`)."""
        return self.stream(None, ref_audio=recording, ref_sample_rate=sample_rate, instruction=instruction,
                           task=edit_task(kind), **kw)  # fmt: skip

    async def synthesize(self, text: str | None, **kw: Unpack[RequestSettings]) -> np.ndarray:
        """The whole utterance as one array, shape (n,) float32 at 24 kHz."""
        chunks = [c.audio async for c in self.stream(text, **kw)]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
