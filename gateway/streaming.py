"""A Triton stream as an HTTP answer: encoded audio bytes, or OpenAI's speech SSE events, with
FireRedTTS3-Instruct's plan text (a designed voice's attributes, a semantic edit's rewritten transcript) in
a header and, over SSE, as the first event.

The request goes to Triton before the headers: the first chunk is awaited, so a refused request is an
error status, not a broken stream, and the plan text, which the server sends before any audio, is known
by then.

Back-pressure: the Triton stream is paced by what the client takes (:mod:`gateway.outbox`): the server
makes its audio at most a lead ahead of the client. It is read as fast as the server sends it into the
connection's outbox (:mod:`gateway.outbox`, the bound every surface shares): a client
that leaves more than ``unsent_seconds`` of audio untaken (made by the server, not yet accepted by the
connection's socket; what the kernel's socket buffers hold is on top) has its stream closed (the slot is
free at the generator's next step) and its connection cut, with one log line. A stream that fails after
its headers went (the server restarted) is cut the same way: one log line, no traceback, and no ending
that would pass for a complete answer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Callable
from urllib.parse import quote

from fastapi.responses import StreamingResponse

from client.pace import Pace
from client.request import TTSError
from gateway.encode import Encoder
from gateway.errors import from_tts_error
from gateway.outbox import ABORT, ClientNotReading, Cut, Outbox, peer_of
from gateway.shares import StreamShares, held, host_of

PLAN_HEADER = "X-Plan-Text"  # the plan text, UTF-8 percent-encoded (a header carries only Latin-1)
PLAN_EVENT = "speech.plan"  # the SSE event that carries it: {"type": "speech.plan", "text": "..."}


async def stream_response(
    open_stream: Callable, kw: dict, response_format: str, stream_format: str, sample_rate: int | None = None,
    unsent_seconds: float | None = None, scope: dict | None = None, shares: StreamShares | None = None,
) -> StreamingResponse:  # fmt: skip
    """``open_stream(**kw, on_plan=...)`` (``AsyncTTSClient.stream`` or ``.edit``) as the answer; ``sample_rate``
    of the raw formats, already checked (None: the format's default); ``unsent_seconds``: the audio its client
    may leave untaken before the stream is ended (None: no bound); ``scope``: the request's ASGI scope
    (its connection is cut when that happens, if the server offers a way); ``shares``: the client address's
    share of streams, held while the Triton stream is open (:mod:`gateway.shares`; over it, a 429)."""
    if shares is not None:
        open_stream = held(open_stream, shares, host_of(scope))
    plans: list[str] = []
    pace = Pace() if unsent_seconds is not None else None  # what the client takes paces the stream (gateway.outbox)
    stream = open_stream(**kw, on_plan=plans.append, **({} if pace is None else {"pace": pace}))
    try:
        first = await anext(stream, None)
    except (TTSError, ConnectionError, TimeoutError) as e:
        raise from_tts_error(e) from None
    cut = Cut(((scope or {}).get("extensions") or {}).get(ABORT), peer_of(scope), "a speech stream")
    if unsent_seconds is not None:
        stream = Unsent(stream, unsent_seconds, cut, pace)
        if first is not None:  # handed to the response with the headers
            pace.took(first.audio.size)
    plan = plans[0] if plans else None
    headers = {PLAN_HEADER: quote(plan, safe="")} if plan is not None else {}
    encoder = Encoder(response_format, sample_rate)
    if stream_format == "sse":
        body, media_type = sse(stream, first, encoder, plan), "text/event-stream"
    else:
        body, media_type = audio_bytes(stream, first, encoder), encoder.media_type
    return StreamingResponse(cut_short(body, cut), media_type=media_type, headers=headers)


async def cut_short(body, cut: Cut):
    """The answer's parts. A stream that fails once the headers are sent (the server restarted, the client
    stopped reading) can no longer get an error status: its connection is cut (the client sees a broken
    answer, not a complete one) with one log line; without a way to cut it, the error is raised."""
    async with contextlib.aclosing(body) as parts:
        try:
            async for part in parts:
                yield part
        except (TTSError, ConnectionError, TimeoutError, ClientNotReading) as e:
            if cut.abort is None:
                raise
            if not isinstance(e, ClientNotReading):  # (that one was cut as it happened)
                kind = e.kind if isinstance(e, TTSError) else type(e).__name__
                cut(f"the stream failed after its start: {kind}: {e}")


async def audio_bytes(stream, first, encoder: Encoder):
    """Encoded bytes as the chunks arrive; leaving early (client gone) closes the Triton stream."""
    try:
        if first is not None:
            yield encoder.push(first.audio)
        async for chunk in stream:
            if data := encoder.push(chunk.audio):
                yield data
        yield encoder.finish()
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
    """A Triton stream's chunks, read from the server as they come by a task of their own into an
    :class:`Outbox` of ``unsent_seconds``, and handed on as the response takes them. Past the bound, the
    Triton stream is closed, ``cut`` ends the connection, and iterating raises :class:`ClientNotReading`."""

    def __init__(self, stream, unsent_seconds: float, cut: Cut, pace: Pace | None = None):
        """``pace``: the stream's (client.pace), told what the response takes."""
        self.stream, self.cut, self.pace = stream, cut, pace
        self.outbox = Outbox(unsent_seconds)
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self.stream:
                self.outbox.put(chunk, chunk.audio.size, self.pace)
            self.outbox.put(StopAsyncIteration())
        except ClientNotReading as e:
            self.cut(str(e))  # first: the response is blocked in a send that only the cut ends
            self.outbox.put(e)
        except Exception as e:  # noqa: BLE001 (handed to the reader, which raises it)
            self.outbox.put(e)
        finally:
            await self.stream.aclose()  # the slot is freed now, not when the client would have read it

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.outbox.get()
        if isinstance(item, BaseException):
            self.outbox.put(item)  # asked again, it says the same
            raise item
        return item

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
