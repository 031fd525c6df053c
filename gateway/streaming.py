"""A Triton stream as an HTTP answer: encoded audio bytes, or OpenAI's speech SSE events, with
FireRedTTS3-Instruct's plan text (a designed voice's attributes, a semantic edit's rewritten transcript) in
a header and, over SSE, as the first event.

The request goes to Triton before the headers: the first chunk is awaited, so a refused request is an
error status, not a broken stream, and the plan text, which the server sends before any audio, is known
by then.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable
from urllib.parse import quote

from fastapi.responses import StreamingResponse

from client.request import TTSError
from gateway.encode import Encoder
from gateway.errors import from_tts_error

PLAN_HEADER = "X-Plan-Text"  # the plan text, UTF-8 percent-encoded (a header carries only Latin-1)
PLAN_EVENT = "speech.plan"  # the SSE event that carries it: {"type": "speech.plan", "text": "..."}


async def stream_response(
    open_stream: Callable, kw: dict, response_format: str, stream_format: str, sample_rate: int | None = None
) -> StreamingResponse:
    """``open_stream(**kw, on_plan=...)`` (``AsyncTTSClient.stream`` or ``.edit``) as the answer; ``sample_rate``
    of the raw formats, already checked (None: the format's default)."""
    plans: list[str] = []
    stream = open_stream(**kw, on_plan=plans.append)
    try:
        first = await anext(stream, None)
    except (TTSError, ConnectionError, TimeoutError) as e:
        raise from_tts_error(e) from None
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
