"""The generator's end of the pipes (serving.stub.chunk_pipe), used by its engine thread only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol import Chunk, end_chunk, failure_reason
from serving.flow.receipts import ReceiptBoard
from serving.stub.chunk_pipe import MAX_PIPES
from serving.stub.triton_io import Throttled

log = logging.getLogger("generator")
# a pipe's reader that has left a response unread this long is asked whether it is alive (its pid: a
# reader that died keeps its entry); one alive that leaves it unread RECEIPT_BACKSTOP_SECONDS is gone (tts
# gives up a stream far sooner, and then says so on the board): either way the pipe ends, its streams lost
READER_CHECK_SECONDS, RECEIPT_BACKSTOP_SECONDS = 1.0, 300.0


@dataclass
class PipeOpening:
    """A reader's request to open a pipe, parsed by ``execute``."""

    pipe_id: int  # the request's correlation id
    sender: object
    receipt: tuple | None  # the pipe's entry on its reader's board (serving.flow.receipts)


class Pipe:
    """An open pipe: its sender, its receipt, its streams and their chunks not sent yet (in step order)."""

    __slots__ = ("held", "queue", "receipt", "sender", "sent", "since", "streams")

    def __init__(self, sender, receipt: tuple | None):
        self.sender, self.receipt = sender, receipt  # receipt None: unpaced
        self.sent = 1  # responses sent: the pipe's opening was answered (Pipes.start)
        self.queue: list[Chunk] = []
        self.since = 0.0  # when the oldest waiting chunk was queued (monotonic)
        self.held = False  # its queue waited for the reader's receipt
        self.streams: set[int] = set()  # the streams whose chunks go on it, until their last went out


class Pipes:
    """The open pipes, oldest first. ``send``: the generator's (serving.stub.generator_host.GeneratorHost);
    ``lose(stream_ids)``: the streams of a pipe that ended, to be ended and marked lost;
    ``waited(seconds)``: how long chunks waited for a receipt (a metric)."""

    def __init__(self, send: Callable[[object, list[Chunk] | None, bool], None],
                 lose: Callable[[set[int]], None], waited: Callable[[float], None]):  # fmt: skip
        self.send, self.lose, self.waited = send, lose, waited
        self.open: dict[int, Pipe] = {}
        self.riding: dict[int, int] = {}  # stream -> its pipe (live, or its last chunk not sent yet)
        self.failures = Throttled(log)

    def unsent(self) -> int:
        """Chunks queued on the pipes, not sent yet."""
        return sum(len(p.queue) for p in self.open.values())

    def start(self, p: PipeOpening) -> None:
        """Register a pipe and answer it at once with an empty response (its reader waits for one)."""
        if p.pipe_id in self.open or not p.pipe_id:
            self.safely(p.sender, [end_chunk(0, failure_reason(ValueError("this pipe id is in use")))], True)
            return
        if len(self.open) >= MAX_PIPES:
            oldest = next(iter(self.open))
            log.warning("more than %d pipes: pipe %x, the oldest, is ended", MAX_PIPES, oldest)
            self.end(oldest, f"more than {MAX_PIPES} pipes were opened")
        if self.safely(p.sender, [], False):
            self.open[p.pipe_id] = Pipe(p.sender, p.receipt)

    def add(self, pipe_id: int, stream_id: int) -> None:
        """The stream's chunks go on the pipe."""
        self.open[pipe_id].streams.add(stream_id)
        self.riding[stream_id] = pipe_id

    def post(self, chunk: Chunk) -> None:
        """Queue a stream's chunk for its pipe's next response."""
        pipe = self.open[self.riding[chunk.stream_id]]  # a pipe that ends loses its streams: they post no more
        if not pipe.queue:
            pipe.since = time.monotonic()
        pipe.queue.append(chunk)

    def flush(self, paced: bool = True) -> None:
        """Send each pipe's queued chunks as one response once its reader has read the one before (all at
        once when not ``paced``); a stream whose last chunk went out is done."""
        for pipe_id, pipe in list(self.open.items()):
            if not pipe.queue:
                continue
            if paced and pipe.receipt is not None:
                read = ReceiptBoard.read(pipe.receipt, pipe_id)
                if read is None:  # the entry names another: nobody reads this pipe any more
                    self.end(pipe_id, "its reader left")
                    continue
                if read < pipe.sent:
                    pipe.held = True
                    waited = time.monotonic() - pipe.since
                    if waited > RECEIPT_BACKSTOP_SECONDS:
                        self.end(pipe_id, f"its reader read nothing for {RECEIPT_BACKSTOP_SECONDS:.0f} s")
                    elif waited > READER_CHECK_SECONDS and not ReceiptBoard.reader_alive(pipe.receipt):
                        self.end(pipe_id, "its reader died")
                    continue
            chunks, pipe.queue = pipe.queue, []
            if pipe.held:
                self.waited(time.monotonic() - pipe.since)
                pipe.held = False
            if not self.safely(pipe.sender, chunks, False):
                self.end(pipe_id, "a response could not be sent")
                continue
            pipe.sent += 1
            for chunk in chunks:
                if chunk.last:
                    pipe.streams.discard(chunk.stream_id)
                    self.riding.pop(chunk.stream_id, None)

    def end(self, pipe_id: int, why: str) -> None:
        """End a pipe: its streams are lost (``lose``), its request gets its final response."""
        pipe = self.open.pop(pipe_id)
        for stream_id in pipe.streams:
            self.riding.pop(stream_id, None)
        if pipe.streams:
            log.warning("pipe %x ended (%s): its %d streams are lost", pipe_id, why, len(pipe.streams))
            self.lose(pipe.streams)
        self.safely(pipe.sender, None, True)

    def safely(self, sender, chunks: list[Chunk] | None, final: bool) -> bool:
        """``send``: whether it went out. A failure means the request's reader or caller is gone, and is logged
        (throttled), never raised."""
        try:
            self.send(sender, chunks, final)
            return True
        except Exception as e:  # noqa: BLE001 (any failure to send: the reader or the caller is gone)
            self.failures.warning("generator: a response could not be sent (%s)", e)
            return False
