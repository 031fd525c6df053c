"""A Triton stream as an HTTP answer: encoded audio bytes, or OpenAI's speech SSE events, with
FireRedTTS3-Instruct's plan text (a designed voice's attributes, a semantic edit's rewritten transcript) in
a header and, over SSE, as the first event.

The request goes to Triton before the headers: the first chunk is awaited, so a refused request is an
error status, not a broken stream, and the plan text, which the server sends before any audio, is known
by then.

Back-pressure: the Triton stream is read as fast as the server makes it, whether or not the client takes
the audio (a gRPC stream that is not read stops tritonserver's writes to it, and the stream kept its
generator slot for as long as its client did not read: 20 such clients held 6 to 7 of 8 slots for
150 s). A stream whose client leaves more than ``unsent_seconds`` of audio untaken (made by the server,
not yet accepted by the connection's socket; what the kernel's socket buffers hold is on top) is ended:
its Triton stream is closed (the slot is free at the generator's next step), the connection is cut and
the gateway logs it by name.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable
from urllib.parse import quote

from fastapi.responses import StreamingResponse

from client.request import TTSError
from engine.protocol import SAMPLE_RATE
from gateway.encode import Encoder
from gateway.errors import from_tts_error

PLAN_HEADER = "X-Plan-Text"  # the plan text, UTF-8 percent-encoded (a header carries only Latin-1)
PLAN_EVENT = "speech.plan"  # the SSE event that carries it: {"type": "speech.plan", "text": "..."}
ABORT = "gateway.abort"  # scope["extensions"][ABORT]: cuts the connection now (gateway.server's protocol sets it)
log = logging.getLogger("gateway")


async def stream_response(
    open_stream: Callable, kw: dict, response_format: str, stream_format: str, sample_rate: int | None = None,
    unsent_seconds: float | None = None, scope: dict | None = None,
) -> StreamingResponse:  # fmt: skip
    """``open_stream(**kw, on_plan=...)`` (``AsyncTTSClient.stream`` or ``.edit``) as the answer; ``sample_rate``
    of the raw formats, already checked (None: the format's default); ``unsent_seconds``: the audio its client
    may leave untaken before the stream is ended (None: no bound); ``scope``: the request's ASGI scope
    (its connection is cut when that happens, if the server offers a way)."""
    plans: list[str] = []
    stream = open_stream(**kw, on_plan=plans.append)
    try:
        first = await anext(stream, None)
    except (TTSError, ConnectionError, TimeoutError) as e:
        raise from_tts_error(e) from None
    if unsent_seconds is not None:
        abort = ((scope or {}).get("extensions") or {}).get(ABORT)
        stream = Unsent(stream, int(unsent_seconds * SAMPLE_RATE), abort)
    plan = plans[0] if plans else None
    headers = {PLAN_HEADER: quote(plan, safe="")} if plan is not None else {}
    encoder = Encoder(response_format, sample_rate)
    if stream_format == "sse":
        return StreamingResponse(sse(stream, first, encoder, plan), media_type="text/event-stream", headers=headers)
    return StreamingResponse(audio_bytes(stream, first, encoder), media_type=encoder.media_type, headers=headers)


async def audio_bytes(stream, first, encoder: Encoder):
    """Encoded bytes as the chunks arrive; leaving early (client gone) closes the Triton stream."""
    try:
        if first is not None:
            yield encoder.push(first.audio)
        async for chunk in stream:
            if data := encoder.push(chunk.audio):
                yield data
        yield encoder.finish()
    except ClientNotReading:
        if not stream.aborted:  # no way to cut the connection: an error, so that the answer is not complete
            raise
    finally:
        await stream.aclose()


async def sse(stream, first, encoder: Encoder, plan: str | None = None):
    """OpenAI's speech SSE events: the plan text (``speech.plan``, ours) if there is one,
    ``speech.audio.delta`` with base64 audio, then ``speech.audio.done``."""
    if plan is not None:
        yield f"data: {json.dumps({'type': PLAN_EVENT, 'text': plan})}\n\n"
    # aclosing: a client that leaves closes the Triton stream now, not whenever the inner generator is collected
    async with contextlib.aclosing(audio_bytes(stream, first, encoder)) as chunks:
        async for data in chunks:
            if data:
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                yield f"data: {json.dumps(event)}\n\n"
    yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n"


class Unsent:
    """A Triton stream's chunks, read from the server as they come by a task of their own, and handed on
    as the response takes them: at most ``limit`` samples wait between the two. Past that, the Triton
    stream is closed, ``abort()`` cuts the connection (if given), and iterating raises
    :class:`ClientNotReading`."""

    def __init__(self, stream, limit: int, abort: Callable[[], None] | None = None):
        self.stream, self.limit, self.abort = stream, limit, abort
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting = 0  # samples made and not yet taken
        self.aborted = False  # the connection was cut
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self.stream:
                self.waiting += chunk.audio.size
                if self.waiting > self.limit:
                    log.warning("a stream was ended: its client left %.1f s of audio untaken (the bound: %.1f s)",
                                self.waiting / SAMPLE_RATE, self.limit / SAMPLE_RATE)  # fmt: skip
                    self.queue.put_nowait(ClientNotReading(self.limit / SAMPLE_RATE))
                    if self.abort is not None:
                        self.abort()
                        self.aborted = True
                    return
                self.queue.put_nowait(chunk)
            self.queue.put_nowait(StopAsyncIteration())
        except Exception as e:  # noqa: BLE001 (handed to the reader, which raises it)
            self.queue.put_nowait(e)
        finally:
            await self.stream.aclose()  # the slot is freed now, not when the client would have read it

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)  # asked again, it says the same
            raise item
        self.waiting -= item.audio.size
        return item

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class ClientNotReading(Exception):
    def __init__(self, seconds: float):
        super().__init__(f"the stream was ended: its client left more than {seconds:g} s of audio untaken")
