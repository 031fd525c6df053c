"""The whole-text core the HTTP dialects speak onto: one request (the fields of ``/v1/audio/speech``,
checked by :func:`gateway.fields.speech_request`) streamed by :func:`gateway.streaming.stream_response`
(the same ``AsyncTTSClient.stream`` call, encoders, and bound on unsent audio as the OpenAI route), with a
tally of the audio made (for a dialect's timings) and an optional gain (Cartesia's ``volume``).

Errors stay :class:`gateway.errors.APIError`; a dialect renders them in its own shape with :func:`answered`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse

from client.aio import AsyncTTSClient
from engine.protocol import SAMPLE_RATE
from gateway.body import MAX_BODY_BYTES, read_capped
from gateway.errors import APIError
from gateway.fields import parse_json, speech_request
from gateway.streaming import stream_response


class Tally:
    """The audio a request's Triton stream has given so far, in samples at the model's 24 kHz (so seconds
    whatever the output rate or codec); complete once the response's body has been read to its end."""

    def __init__(self):
        self.samples = 0

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE


@dataclasses.dataclass(frozen=True)
class Core:
    """What a dialect's routes share with the OpenAI route."""

    tts: AsyncTTSClient
    voices: Callable[[], Awaitable[list[dict]]]  # the registered voices (gateway.app.VoiceList.get)
    body_timeout: float  # seconds for a request body to arrive

    async def body(self, request: Request) -> dict:
        """The request's JSON object, read within the speech route's bounds."""
        too_big = f"the request body is over {MAX_BODY_BYTES} bytes"
        return parse_json(await read_capped(request, MAX_BODY_BYTES, too_big, self.body_timeout))

    async def speak(
        self, fields: dict, request: Request, response_format: str, sample_rate: int | None = None,
        volume: float | None = None, stream_format: str = "audio",
    ) -> tuple[StreamingResponse, Tally]:  # fmt: skip
        """``fields``: a ``/v1/audio/speech`` body (a vendor dialect's without its format: ``input``, ``voice``,
        ``language``, ``speed``, ``seed``, ``instructions``, our parameters); ``response_format`` and
        ``sample_rate``: an :class:`gateway.encode.Encoder`'s, checked (by ``speech_request`` when they are
        among ``fields``, else by the dialect); ``stream_format``: ``audio`` (bytes; what the vendor dialects
        frame their own way) or OpenAI's ``sse`` -> the streaming answer and the tally of its audio. The
        request reaches Triton before this returns: a refusal is an :class:`APIError`."""
        kw = await speech_request(fields, self.voices)
        tally = Tally()
        unsent = request.app.state.budgets.bounds.unsent_seconds
        response = await stream_response(tapped(self.tts.stream, tally, volume), kw, response_format, stream_format,
                                         sample_rate, unsent, request.scope, request.app.state.shares)  # fmt: skip
        return response, tally


def tapped(open_stream: Callable, tally: Tally, gain: float | None) -> Callable:
    """``open_stream`` whose chunks are counted into ``tally`` and scaled by ``gain`` (the encoders clip);
    closing it closes the Triton stream at once."""

    async def stream(**kw):
        async with contextlib.aclosing(open_stream(**kw)) as chunks:
            async for chunk in chunks:
                tally.samples += chunk.audio.size
                yield chunk if gain is None else dataclasses.replace(chunk, audio=chunk.audio * np.float32(gain))

    return stream


def answered(render: Callable[[APIError, Request], dict]) -> Callable:
    """A route decorator: an :class:`APIError` the route raises is answered with the body ``render`` makes
    of it (the dialect's error shape) instead of the app's OpenAI shape, with the same status and headers.
    The route takes ``request: Request`` by that name."""

    def wrap(route):
        @functools.wraps(route)  # FastAPI reads the route's own signature (its path parameters)
        async def handler(request: Request, **path):
            try:
                return await route(request, **path)
            except APIError as e:
                return e.response(render(e, request))

        return handler

    return wrap
