"""What the agent socket's text goes into: a *text stream* (``AsyncTTSClient.open_text``, :mod:`client.text_in`)
takes one utterance's text in pieces and yields its audio, each segment as soon as its text is complete.

The socket (:mod:`gateway.text_socket`) holds a :data:`TextStreams`, ``await open(**fields)`` with the
fields of ``AsyncTTSClient.stream`` other than ``text``, and speaks to what it returns only through
:class:`TextStream`, so that its tests run over an in-process stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from client.text_in import Flushed
from client.tts_client import Chunk


class TextStream(Protocol):
    async def send(self, text: str, flush: bool = False) -> None:
        """A piece of text; ``flush``: speak what was sent so far now, as its own segment."""

    async def end(self) -> None:
        """No more text: the rest is spoken, then the iteration ends."""

    async def cancel(self) -> None:
        """Stop now (barge-in): generation stops, the slot is freed, the iteration ends."""

    def __aiter__(self) -> AsyncIterator[Chunk | Flushed]:
        """Audio (``Chunk.audio``: float32 at 24 kHz) and, after the audio of the n-th flush, ``Flushed(n)``."""


TextStreams = Callable[..., Awaitable[TextStream]]  # AsyncTTSClient.open_text
