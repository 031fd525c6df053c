"""Text-in streams of the ``tts`` model: a client's gRPC sequence (keyed by its ``correlation_id()``) whose
requests carry the pieces of one utterance's text, read by :meth:`engine.orchestrator.Orchestrator.run_text`.
Its bounds and why ``tts`` keeps the table itself: docs/serving.md, "Text in: a gRPC sequence"."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Hashable

from engine.frontend.text_in import RELEASES
from engine.orchestrator import TextPiece
from engine.params import shown
from engine.protocol import Unavailable, tagged
from serving.contract import DEFAULT_RELEASE, DEFAULT_TEXT_MAX_SECONDS, MAX_STREAM_CHARS, MAX_STREAM_PIECES
from serving.flow.admission import TextPlace
from serving.intake.requests import check_text
from serving.stub.triton_io import scalar, string

PIECE_INPUTS = {"TEXT", "FLUSH"}  # what a stream's later requests may carry
STREAMED = "(streamed)"  # a stream's TEXT for the request checks that want one before the text has come


class TextStream:
    """The pieces of one stream, from the requests that carry them to the orchestrator that reads them."""

    def __init__(self, key: Hashable, idle_seconds: float, max_seconds: float, place: TextPlace | None):
        self.key, self.idle_seconds, self.max_seconds, self.place = key, idle_seconds, max_seconds, place
        # place: the stream's admission place (None: it holds none, as in tests of the table alone)
        self.deadline = time.monotonic() + max_seconds  # its END must have come by then
        self.queue: asyncio.Queue = asyncio.Queue()  # TextPiece, None (the end) or a ValueError (failed)
        self.chars = self.pieces = 0
        self.ended = False
        self.failure: str | None = None  # why the stream failed (a tagged message); None: it did not

    def add(self, text: str, flush: bool, end: bool) -> None:
        """One request's piece (its TEXT may be ""); ValueError when it breaks a bound, Unavailable when its text
        finds the admission gate full: either fails the stream. A control token split across pieces is refused by
        :func:`engine.frontend.prepare`."""
        if self.ended or self.failure:
            raise ValueError(f"text stream {self.key} has ended; start a new sequence")
        try:
            if self.place is not None:
                self.place.came(text)  # before the piece is queued: nothing is spoken without a place
            check_text(text, required=False)
            self.pieces += 1
            self.chars += len(text)
            if self.pieces > MAX_STREAM_PIECES:
                raise ValueError(f"text stream: over {MAX_STREAM_PIECES} requests in one stream; start another")
            if self.chars > MAX_STREAM_CHARS:
                raise ValueError(f"text stream: over {MAX_STREAM_CHARS} characters of text in one stream; "
                                 "start another")  # fmt: skip
        except (ValueError, Unavailable) as e:
            self.fail(tagged(e))
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
        """The pieces as they come, until END; ValueError when the stream failed, no piece came for
        ``idle_seconds``, or END had not come ``max_seconds`` after START."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.fail(f"text stream: open for over {self.max_seconds:g} s without its end; the stream is "
                          "closed (send each turn as a stream of its own)")  # fmt: skip
                item = self.queue.get_nowait()  # never empty: the failure is in it, after what came before
            else:
                try:
                    async with asyncio.timeout(min(self.idle_seconds, left)):
                        item = await self.queue.get()
                except TimeoutError:
                    if time.monotonic() < self.deadline:
                        self.fail(f"text stream: no text for {self.idle_seconds:g} s; the stream is closed")
                    continue  # the failure is in the queue now (or the lifetime's comes next)
            if item is None:
                return
            if isinstance(item, ValueError):
                raise item
            if self.place is not None:
                self.place.read(item.text)
            yield item


class TextStreams:
    """The open streams of one ``tts`` instance, by sequence id (one event loop uses it)."""

    def __init__(self, idle_seconds: float, max_seconds: float = DEFAULT_TEXT_MAX_SECONDS,
                 max_open: int | None = None, place: Callable[[], TextPlace] | None = None):  # fmt: skip
        """``max_open``: streams open at once (None: no bound); ``place``: a new stream's admission place."""
        self.idle_seconds, self.max_seconds, self.max_open, self.place = idle_seconds, max_seconds, max_open, place
        self.open: dict[Hashable, TextStream] = {}

    def start(self, key: Hashable) -> TextStream:
        """A new stream (ValueError: the id is open; Unavailable: ``max_open`` streams are)."""
        if key in self.open:
            raise ValueError(f"sequence id {key} is an open text stream's; send START with an id of its own")
        if self.max_open is not None and len(self.open) >= self.max_open:
            raise Unavailable(f"too many open text streams ({len(self.open)}, limit {self.max_open}); end a "
                              "stream or retry shortly")  # fmt: skip
        self.open[key] = TextStream(key, self.idle_seconds, self.max_seconds, self.place and self.place())
        return self.open[key]

    def get(self, key: Hashable) -> TextStream:
        stream = self.open.get(key)
        if stream is None:
            raise ValueError(f"no open text stream has sequence id {key}: its first request needs START (and a "
                             "stream that ended or failed takes no more text)")  # fmt: skip
        return stream

    def close(self, stream: TextStream) -> None:
        """The stream's audio request is over (or its START refused): later pieces are refused, its place freed."""
        if self.open.get(stream.key) is stream:
            del self.open[stream.key]
        if stream.place is not None:
            stream.place.close()


def start_stream(pb, streams: TextStreams, request, key: Hashable) -> tuple[TextStream | None, str | None]:
    """Open stream ``key`` with the piece of its START ``request`` -> (the stream, None), or (None, the
    tagged error to answer it with; nothing is left open)."""
    try:
        stream = streams.start(key)
    except (ValueError, Unavailable) as e:
        return None, tagged(e)
    if error := take_piece(pb, streams, request, key):
        streams.close(stream)
        return None, error
    return stream, None


def take_piece(pb, streams: TextStreams, request, key: Hashable) -> str | None:
    """Hand the piece of ``request`` (TEXT, FLUSH, END) to stream ``key`` -> None, or the tagged error to answer
    it with (the stream fails with it when it broke a bound, or its text found the admission gate full)."""
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
    except (ValueError, Unavailable) as e:
        return tagged(e)
    return None


def release_of(pb, request) -> str:
    """The RELEASE of a stream's first request (ValueError naming it)."""
    release = string(pb, request, "RELEASE", DEFAULT_RELEASE)
    if release not in RELEASES:
        raise ValueError(f"RELEASE must be {' or '.join(RELEASES)}, got {shown(release)}")
    return release
