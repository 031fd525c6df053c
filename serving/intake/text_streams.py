"""Text-in streams of the ``tts`` model: a client's gRPC sequence whose requests carry the pieces of one
utterance's text (no Triton here; the ``tts`` model feeds it, :meth:`engine.orchestrator.Orchestrator.run_text`
reads it).

A stream is keyed by the client's sequence id (``request.correlation_id()``: Triton hands it to a model
without a sequence batcher, with the START and END flags, in the order the requests came on the stream).
The START request opens it and carries its audio back; every later request is one piece, answered at once
(or refused), and END is the last. Bounds: :data:`~serving.contract.MAX_STREAM_CHARS` of text and
:data:`~serving.contract.MAX_STREAM_PIECES` requests per stream, and ``idle_seconds`` between pieces; a
stream past one fails with an ``invalid:`` message naming it, and so frees what it held.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable

from engine.frontend.text_in import RELEASES
from engine.orchestrator import TextPiece
from engine.params import shown
from engine.protocol import tagged
from serving.contract import DEFAULT_RELEASE, MAX_STREAM_CHARS, MAX_STREAM_PIECES
from serving.intake.requests import check_text
from serving.stub.triton_io import scalar, string

PIECE_INPUTS = {"TEXT", "FLUSH"}  # what a stream's later requests may carry
STREAMED = "(streamed)"  # a stream's TEXT for the request checks that want one before the text has come


class TextStream:
    """The pieces of one stream, from the requests that carry them to the orchestrator that reads them."""

    def __init__(self, key: Hashable, idle_seconds: float):
        self.key, self.idle_seconds = key, idle_seconds
        self.queue: asyncio.Queue = asyncio.Queue()  # TextPiece, None (the end) or a ValueError (failed)
        self.chars = self.pieces = 0
        self.ended = False
        self.failure: str | None = None  # why the stream failed (an invalid: message); None: it did not

    def add(self, text: str, flush: bool, end: bool) -> None:
        """One request's piece (its TEXT may be ""); ValueError when it breaks a bound, which also fails the
        stream (its audio request ends with the same message). A control token in the piece is refused here; one
        split across pieces (or formed by cleaning) is refused when its unit is cut into segments
        (:func:`engine.frontend.prepare` checks the text as the tokenizer reads it)."""
        if self.ended or self.failure:
            raise ValueError(f"text stream {self.key} has ended; start a new sequence")
        try:
            check_text(text, required=False)
            self.pieces += 1
            self.chars += len(text)
            if self.pieces > MAX_STREAM_PIECES:
                raise ValueError(f"text stream: over {MAX_STREAM_PIECES} requests in one stream; start another")
            if self.chars > MAX_STREAM_CHARS:
                raise ValueError(f"text stream: over {MAX_STREAM_CHARS} characters of text in one stream; "
                                 "start another")  # fmt: skip
        except ValueError as e:
            self.fail(str(e))
            raise
        self.queue.put_nowait(TextPiece(text, flush))
        if end:
            self.ended = True
            self.queue.put_nowait(None)

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            self.queue.put_nowait(ValueError(message))

    async def read(self) -> AsyncIterator[TextPiece]:
        """The pieces as they come, until END; ValueError when the stream failed or no piece came for
        ``idle_seconds``."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), self.idle_seconds)
            except TimeoutError:
                self.fail(f"text stream: no text for {self.idle_seconds:g} s; the stream is closed")
                continue  # the failure is in the queue now
            if item is None:
                return
            if isinstance(item, ValueError):
                raise item
            yield item


class TextStreams:
    """The open streams of one ``tts`` instance, by sequence id (one event loop uses it)."""

    def __init__(self, idle_seconds: float):
        self.idle_seconds = idle_seconds
        self.open: dict[Hashable, TextStream] = {}

    def start(self, key: Hashable) -> TextStream:
        if key in self.open:
            raise ValueError(f"sequence id {key} is an open text stream's; send START with an id of its own")
        stream = self.open[key] = TextStream(key, self.idle_seconds)
        return stream

    def get(self, key: Hashable) -> TextStream:
        stream = self.open.get(key)
        if stream is None:
            raise ValueError(f"no open text stream has sequence id {key}: its first request needs START (and a "
                             "stream that ended or failed takes no more text)")  # fmt: skip
        return stream

    def close(self, stream: TextStream) -> None:
        """The stream's audio request is over: later pieces are refused."""
        if self.open.get(stream.key) is stream:
            del self.open[stream.key]


def start_stream(pb, streams: TextStreams, request, key: Hashable) -> tuple[TextStream | None, str | None]:
    """Open stream ``key`` with the piece of its START ``request`` -> (the stream, None), or (None, the
    tagged error to answer it with; nothing is left open)."""
    try:
        stream = streams.start(key)
    except ValueError as e:
        return None, tagged(e)
    error = take_piece(pb, streams, request, key)
    if error:
        streams.close(stream)
        return None, error
    return stream, None


def take_piece(pb, streams: TextStreams, request, key: Hashable) -> str | None:
    """Hand the piece of ``request`` (``pb``: triton_python_backend_utils) to stream ``key``: its TEXT,
    FLUSH and END flag. Returns None, or the tagged error to answer it with (the stream fails with it when
    it broke a bound)."""
    try:
        end = bool(request.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        if not request.flags() & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
            extra = {t.name() for t in request.inputs()} - PIECE_INPUTS
            if extra:
                raise ValueError(f"{', '.join(sorted(extra))}: only the first request of a text-in stream (START) "
                                 f"takes them; later ones carry {' and '.join(sorted(PIECE_INPUTS))}")  # fmt: skip
        flush = scalar(pb, request, "FLUSH", False)
        if not isinstance(flush, bool):
            raise ValueError(f"FLUSH must be a BOOL, got {type(flush).__name__}")  # noqa: TRY004 (invalid: input)
        streams.get(key).add(string(pb, request, "TEXT", ""), flush, end)
    except ValueError as e:
        return tagged(e)
    return None


def release_of(pb, request) -> str:
    """The RELEASE of a stream's first request (ValueError naming it)."""
    release = string(pb, request, "RELEASE", DEFAULT_RELEASE)
    if release not in RELEASES:
        raise ValueError(f"RELEASE must be {' or '.join(RELEASES)}, got {shown(release)}")
    return release
