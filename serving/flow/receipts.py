"""The reader's board, one mmap per reading model, written by it (:class:`Receipts`) and read by the generator
(:class:`ReceiptBoard`): docs/architecture.md, "Read receipts and pacing: the reader's board" (T22, T23).
Little-endian int64s: the reader's pid, :data:`HELD` held streams (0: free), then per pipe (id, responses read)."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from serving.flow.admission import ADMITTERS, int64

PARAMETER = "receipt"  # a pipe opening's entry on its reader's board: "<reader>:<index>"
FILE = "receipts-"  # + the reading model's name
# entries per board: a reader holds one per pipe whose reading thread runs (its open pipe, the rotated ones
# that still carry streams: serving.stub.pipe_reader, and ones the generator has not ended yet)
ENTRIES = 64
# held streams per board: a reader's generator streams, at most one per slot (serving.config.options.MAX_SLOTS)
HELD = 1024
_ENTRY = struct.Struct("<qq")  # pipe id, responses read
_HELD = 8  # after the reader's pid: the held stream ids, then the entries
HEAD = _HELD + 8 * HELD  # bytes before the entries


def _path(board: str | Path, sender: str) -> Path:
    """``sender``: a reading model, or one process of it (``tts.<pid>``: tts has several instances)."""
    model, dot, process = sender.partition(".")
    if model not in ADMITTERS or dot and not process.isdigit():
        raise ValueError(f"unknown sender {sender!r}")
    return Path(board) / f"{FILE}{sender}"


class Receipts:
    """A reading model's board (``tts`` or ``ensemble_generator``), ``capacity`` entries; one per process, used
    from its event loop (:meth:`open`, :meth:`hold`) and its pipes' reading threads (:meth:`Receipt.read`)."""

    def __init__(self, board: str | Path, sender: str, capacity: int = ENTRIES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.sender, self.capacity = sender, capacity
        size = HEAD + _ENTRY.size * capacity
        fd = os.open(_path(board, sender), os.O_RDWR | os.O_CREAT, 0o600)
        try:  # never shrunk: the generator may have it mapped (a read past its end would kill it)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.map[:] = bytes(size)  # a dead run's entries and holds are void
        self.map[:_HELD] = int64(os.getpid())
        self.free = list(range(capacity - 1, -1, -1))  # entries nobody uses, the lowest taken first
        self.held: dict[int, int] = {}  # held stream -> its place (the event loop only, as the places)
        self.places = list(range(HELD - 1, -1, -1))  # places no stream holds
        self.lock = threading.Lock()  # an entry is counted (a reading thread) or reopened (the loop), never both

    def open(self, pipe_id: int) -> Receipt | None:
        """An entry for ``pipe_id``, written (id, 0 read); None when every entry is in use."""
        if not self.free:
            return None
        index = self.free.pop()
        with self.lock:
            _ENTRY.pack_into(self.map, HEAD + _ENTRY.size * index, int(pipe_id), 0)
        return Receipt(self, index, int(pipe_id))

    def hold(self, stream_id: int) -> None:
        """The generator does not step the stream until :meth:`release` (a pace mark: serving.flow.pacing)."""
        if stream_id not in self.held:  # (places run out only past MAX_SLOTS streams: IndexError)
            place = self.held[stream_id] = self.places.pop()
            self.map[_HELD + 8 * place : _HELD + 8 * place + 8] = int64(stream_id)

    def release(self, stream_id: int) -> None:
        """The stream may step again (or it ended); releasing one not held does nothing."""
        place = self.held.pop(stream_id, None)
        if place is not None:
            self.map[_HELD + 8 * place : _HELD + 8 * place + 8] = bytes(8)
            self.places.append(place)


class Receipt:
    """One pipe's entry on its reader's board; :attr:`parameter`: the pipe opening's :data:`PARAMETER`."""

    def __init__(self, receipts: Receipts, index: int, pipe_id: int):
        self.receipts, self.index, self.pipe_id = receipts, index, pipe_id
        self.at, self.parameter = HEAD + _ENTRY.size * index, f"{receipts.sender}:{index}"

    def read(self) -> None:
        """One more response of the pipe was read (from the thread that read it); a late read of a closed
        entry counts nothing (pipe ids are never 0, nor reused)."""
        with self.receipts.lock:
            pipe_id, count = _ENTRY.unpack_from(self.receipts.map, self.at)
            if pipe_id == self.pipe_id:
                self.receipts.map[self.at + 8 : self.at + 16] = int64(count + 1)  # the count alone

    def close(self) -> None:
        """Nobody reads the pipe any more: the generator ends it, and the entry is free (once)."""
        with self.receipts.lock:
            if _ENTRY.unpack_from(self.receipts.map, self.at)[0] != self.pipe_id:
                return
            _ENTRY.pack_into(self.receipts.map, self.at, 0, 0)
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
                if size < HEAD + _ENTRY.size:
                    return None
                board = self.maps[sender] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        if not index.isdigit() or HEAD + (int(index) + 1) * _ENTRY.size > len(board):
            raise ValueError(f"{PARAMETER} {value!r} names no entry")
        return board, HEAD + int(index) * _ENTRY.size

    @staticmethod
    def read(entry: tuple[mmap.mmap, int], pipe_id: int) -> int | None:
        """How many of ``pipe_id``'s responses were read; None when the entry names another pipe."""
        board, at = entry
        entry_id, count = _ENTRY.unpack_from(board, at)
        return count if entry_id == pipe_id else None

    @staticmethod
    def reader_alive(entry: tuple[mmap.mmap, int]) -> bool:
        """Whether the process that owns the entry's board still exists (a ``kill(pid, 0)``)."""
        try:
            os.kill(int.from_bytes(entry[0][:_HELD], "little", signed=True), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            pass
        return True

    def held(self) -> set[int]:
        """The streams every open board holds (one read of each: no system call)."""
        out: set[int] = set()
        for board in self.maps.values():
            ids = np.frombuffer(board, "<i8", HELD, _HELD)
            out.update(int(i) for i in ids[ids.nonzero()])
        return out
