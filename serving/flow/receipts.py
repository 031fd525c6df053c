"""Read receipts: the generator sends a pipe's next response only once its reader has read the one before.

Why: docs/triton.md#T23 (a decoupled BLS call can deadlock the stub; with at most one unread response per
generator pipe, the response that closes the cycle never exists).

The board: one file per reading model (``receipts-tts``, ``receipts-ensemble_generator``) in the run's side
channel folder (serving.flow.side_channel), :data:`ENTRIES` entries of two little-endian int64: a pipe id,
then how many of its responses were read. The reader owns its file. :meth:`Receipts.open` gives a pipe an
entry (a free list in the reading process) and writes (id, 0) before the pipe's opening request goes out;
the request names the entry in its :data:`PARAMETER` (``"tts:3"``); the pipe's reading thread counts each
response as soon as ``next`` has returned it (:meth:`Receipt.read`); :meth:`Receipt.close` writes id 0 once
nobody reads the pipe any more. The generator only reads (:class:`ReceiptBoard`): an entry that names
another pipe (closed, or reused) means nobody reads this one, and the generator ends it. A reader with no
free entry opens no pipe (serving.stub.pipe_reader).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path

from serving.flow.admission import ADMITTERS

PARAMETER = "receipt"  # a pipe opening's entry on its reader's board: "<reader>:<index>"
FILE = "receipts-"  # + the reading model's name
# entries per board: a reader holds one per pipe whose reading thread runs (its open pipe, the rotated ones
# that still carry streams: serving.stub.pipe_reader, and ones the generator has not ended yet)
ENTRIES = 64
_ENTRY = struct.Struct("<qq")  # pipe id, responses read


def _path(board: str | Path, sender: str) -> Path:
    if sender not in ADMITTERS:
        raise ValueError(f"unknown sender {sender!r}")
    return Path(board) / f"{FILE}{sender}"


class Receipts:
    """A reading model's board (``tts`` or ``ensemble_generator``), ``capacity`` entries; one per process, used
    from its event loop (:meth:`open`) and its pipes' reading threads (:meth:`Receipt.read`)."""

    def __init__(self, board: str | Path, sender: str, capacity: int = ENTRIES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.sender, self.capacity = sender, capacity
        size = _ENTRY.size * capacity
        fd = os.open(_path(board, sender), os.O_RDWR | os.O_CREAT, 0o600)
        try:  # never shrunk: the generator may have it mapped (a read past its end would kill it)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.map[:] = bytes(size)  # a dead run's entries are void
        self.free = list(range(capacity - 1, -1, -1))  # entries nobody uses, the lowest taken first
        self.lock = threading.Lock()  # an entry is counted (a reading thread) or reopened (the loop), never both

    def open(self, pipe_id: int) -> Receipt | None:
        """An entry for ``pipe_id``, written (id, 0 read); None when every entry is in use."""
        if not self.free:
            return None
        index = self.free.pop()
        with self.lock:
            _ENTRY.pack_into(self.map, _ENTRY.size * index, int(pipe_id), 0)
        return Receipt(self, index, int(pipe_id))


class Receipt:
    """One pipe's entry on its reader's board."""

    def __init__(self, receipts: Receipts, index: int, pipe_id: int):
        self.receipts, self.index, self.pipe_id = receipts, index, pipe_id
        self.closed = False

    @property
    def parameter(self) -> str:
        """The value of the pipe opening's :data:`PARAMETER`."""
        return f"{self.receipts.sender}:{self.index}"

    def read(self) -> None:
        """One more response of the pipe was read (from the thread that read it)."""
        at = _ENTRY.size * self.index
        with self.receipts.lock:
            pipe_id, count = _ENTRY.unpack_from(self.receipts.map, at)
            if pipe_id == self.pipe_id and not self.closed:  # a late read of a closed entry counts nothing
                # the count alone, copied in whole: struct's pack_into zero-fills its target before it
                # writes the fields, and the generator (another process) then saw id 0 for an instant: "its
                # reader left", and a pipe ended with its streams on it
                self.receipts.map[at + 8 : at + 16] = (count + 1).to_bytes(8, "little", signed=True)

    def close(self) -> None:
        """Nobody reads the pipe any more: the generator ends it, and the entry is free."""
        if self.closed:
            return
        self.closed = True
        with self.receipts.lock:
            _ENTRY.pack_into(self.receipts.map, _ENTRY.size * self.index, 0, 0)
        self.receipts.free.append(self.index)


class ReceiptBoard:
    """The generator's view of every reader's board (read only; a board is opened when a pipe names it)."""

    def __init__(self, board: str | Path):
        self.dir = Path(board)
        self.maps: dict[str, mmap.mmap] = {}

    def entry(self, value: str) -> tuple[mmap.mmap, int] | None:
        """A request's :data:`PARAMETER` -> its entry (map, byte offset), or None: no parameter, or a board
        that does not exist: its pipe goes unpaced (a test's or a benchmark's over gRPC; tts and
        ensemble_generator always name an entry). ValueError for a value that names no entry."""
        if not value:
            return None
        sender, _, index = str(value).partition(":")
        board = self.maps.get(sender)
        if board is None:
            try:
                fd = os.open(_path(self.dir, sender), os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size < _ENTRY.size:
                    return None
                board = self.maps[sender] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        if not index.isdigit() or int(index) * _ENTRY.size >= len(board):
            raise ValueError(f"{PARAMETER} {value!r} names no entry")
        return board, int(index) * _ENTRY.size

    @staticmethod
    def read(entry: tuple[mmap.mmap, int], pipe_id: int) -> int | None:
        """How many of ``pipe_id``'s responses were read; None when the entry names another pipe."""
        board, at = entry
        entry_id, count = _ENTRY.unpack_from(board, at)
        return count if entry_id == pipe_id else None
