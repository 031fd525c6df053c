"""Where the agent socket's text goes: a *text stream* takes an utterance's text in pieces and yields its audio.

The socket (:mod:`gateway.agent_socket`) holds a :data:`TextStreams`, ``await open(**fields)`` with the
fields of ``AsyncTTSClient.stream`` other than ``text``, and speaks to what it returns only through
:class:`TextStream`: ``send(text, flush)``, ``end()``, ``cancel()`` and ``async for`` over audio chunks
(``.audio``, float32 at 24 kHz) and flush markers (anything without ``.audio``, whose ``n`` says that all
audio up to the n-th flush came before it).

:class:`UnitStreams` is the plain implementation over ``AsyncTTSClient.stream``: the text between two
flushes (or a flush and the end) is one ordinary request, spoken in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Flushed:
    """All audio of the text up to the ``n``-th flush (1-based) has been yielded."""

    n: int


class TextStream(Protocol):
    async def send(self, text: str, flush: bool = False) -> None: ...

    async def end(self) -> None: ...

    async def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Any]: ...


TextStreams = Callable[..., Awaitable[TextStream]]
_END = object()


class UnitStreams:
    """``open(**fields)`` -> a :class:`UnitStream` over ``tts.stream`` (an ``AsyncTTSClient``)."""

    def __init__(self, tts):
        self.tts = tts

    async def __call__(self, **fields) -> UnitStream:
        return UnitStream(self.tts, fields)


class UnitStream:
    """One ``stream()`` request per flushed unit, in order; a unit of blank text makes no request. Its
    producer runs as a task from the first ``send``, so ``cancel`` stops the request under way at once."""

    def __init__(self, tts, fields: dict):
        self.tts, self.fields = tts, fields
        self.pending, self.flushes = "", 0
        self.units: asyncio.Queue = asyncio.Queue()  # (text, flush number or 0) ... then _END
        self.out: asyncio.Queue = asyncio.Queue()  # chunks, Flushed, an exception, then _END
        self.task = asyncio.create_task(self._produce())
        self.finished = False

    async def send(self, text: str, flush: bool = False) -> None:
        self.pending += text
        if flush:
            self.flushes += 1
            self.units.put_nowait((self.pending, self.flushes))
            self.pending = ""

    async def end(self) -> None:
        self.units.put_nowait((self.pending, 0))
        self.pending = ""
        self.units.put_nowait(_END)

    async def cancel(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.out.put_nowait(_END)

    async def _produce(self) -> None:
        try:
            while (unit := await self.units.get()) is not _END:
                text, flush = unit
                if text.strip():
                    async for chunk in self.tts.stream(text, **self.fields):
                        self.out.put_nowait(chunk)
                if flush:
                    self.out.put_nowait(Flushed(flush))
        except Exception as e:  # noqa: BLE001 (raised to the reader, in order)
            self.out.put_nowait(e)
        self.out.put_nowait(_END)

    def __aiter__(self) -> UnitStream:
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self.out.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.finished = True
            raise item
        return item
