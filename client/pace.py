"""Pacing a stream by what its listener has taken (the server's side: serving.flow.pacing).

A paced request carries a token of the client's (request parameter ``pace``); while it runs, the client
sends *pace requests* on the same gRPC stream: parameters ``pace`` = the token and ``delivered`` = seconds
of the request's audio its listener has taken. The server keeps its generator at most two of the request's
largest chunks (``2 x chunk_next x 0.16 s``) ahead of that, and ends the request once it has been paused
with nothing taken for ``--pace-hold-seconds``. A client without a token is unpaced: it is sent audio as
fast as it is made, up to the fronts' unsent bound.

:class:`Pace` counts what was taken (:meth:`Pace.took`) and reports it when it grew by :data:`REPORT_SECONDS`,
or at once when the listener has taken all it was given (:meth:`Pace.caught_up`): a server that paused the
stream then hears everything and resumes it. ``AsyncTTSClient.stream(..., pace=...)`` and ``open_text``
send the reports; the gateway's outbox (gateway.outbox) counts what its clients take.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from engine.protocol import SAMPLE_RATE
from serving.contract import DELIVERED, PACE, PACE_REQUEST

REPORT_SECONDS = 1.0  # a report goes out once the audio taken grew by this much (not per chunk)
REQUEST_ID = "pace"  # a pace request's id: its response (if any) is told from the stream's own
CAUGHT_UP_SECONDS = 0.05  # a client that counts its own chunks: no response this long means all was taken


def pace_request(model: str, token: str, delivered: float, tc=None) -> dict:
    """One pace request, as ``stream_infer`` takes it."""
    from client.request import grpc_inputs

    return {"model_name": model, "inputs": grpc_inputs({"TEXT": ""}, tc, model=model), "request_id": REQUEST_ID,
            "parameters": {PACE: token, DELIVERED: float(delivered)}}  # fmt: skip


def is_pace_error(error) -> bool:
    """Whether a stream's error answers a pace request (one sent after the request ended, say), not the stream."""
    return PACE_REQUEST in str(error)


class Pace:
    """One paced request's delivery: ``token`` (default: a new random one), the 24 kHz samples taken, and the
    reports of them (``send(seconds)``, set by the stream that carries them: :meth:`attach`)."""

    def __init__(self, token: str | None = None, report_seconds: float = REPORT_SECONDS):
        self.token = token or secrets.token_urlsafe(24)  # 32 characters of A-Z a-z 0-9 _ -
        self.every = max(1, int(report_seconds * SAMPLE_RATE))
        self.taken = self.reported = 0  # samples
        self.send: Callable[[float], None] | None = None

    def attach(self, send: Callable[[float], None]) -> None:
        self.send = send

    def took(self, samples: int) -> None:
        """The listener took ``samples`` more; a report goes out once they add up to :data:`REPORT_SECONDS`."""
        self.taken += samples
        if self.taken - self.reported >= self.every:
            self._report()

    def caught_up(self) -> None:
        """The listener has taken all it was given: report what it took, if not reported yet."""
        if self.taken > self.reported:
            self._report()

    def _report(self) -> None:
        self.reported = self.taken
        if self.send is not None:
            self.send(self.taken / SAMPLE_RATE)


class PaceFeed:
    """A stream's requests for ``stream_infer``: the first ones, then pace reports until :meth:`close`."""

    def __init__(self, model: str, pace: Pace | None):
        self.model, self.pace = model, pace
        self.queue: asyncio.Queue = asyncio.Queue()
        if pace is not None:
            pace.attach(lambda seconds: self.queue.put_nowait(pace_request(model, pace.token, seconds)))

    def put(self, request: dict | None) -> None:
        self.queue.put_nowait(request)

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def requests(self):
        while (request := await self.queue.get()) is not None:
            yield request


async def next_response(responses, pace: Pace | None, own: bool, limit: float | None):
    """``anext(responses)`` within ``limit`` seconds (None: no limit); a client that counts its own chunks (``own``) and gets no
    response for :data:`CAUGHT_UP_SECONDS` has taken all it was given (:meth:`Pace.caught_up`)."""
    # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that comes as the response does
    if pace is None or not own or pace.taken == pace.reported:
        async with asyncio.timeout(limit):
            return await anext(responses)
    task = asyncio.ensure_future(anext(responses))
    try:
        done, _ = await asyncio.wait({task}, timeout=CAUGHT_UP_SECONDS)
    except BaseException:
        task.cancel()
        raise
    if not done:
        pace.caught_up()
    async with asyncio.timeout(None if limit is None else max(0.0, limit - CAUGHT_UP_SECONDS)):
        return await task
