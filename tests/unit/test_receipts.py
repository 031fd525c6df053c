"""The reader's board (serving.flow.receipts, docs/triton.md#T23, T22): it counts the responses read per
pipe; the generator's view sees the count, or None once the entry names another pipe (closed, reused); a
read that lands after its entry was closed counts nothing; a full board opens nothing, and a reader then
opens no pipe (never one unpaced). It holds streams (pacing) until released, and a restart releases them.
And the generator's engine thread (serving.stub.generator_host) sends a pipe's next response only once the
one before was read, ends the pipe (its streams lost) when its reader closes the entry or its reader died,
and sends everything at once when it shuts down. No Triton."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.chunking import ChunkSchedule
from engine.params import GenerationParams
from engine.protocol import StreamFailed
from serving.flow.receipts import ENTRIES, HEAD, HELD, PARAMETER, ReceiptBoard, Receipts
from serving.flow.side_channel import SideChannel
from serving.stub.generator_host import Arrival
from serving.stub.generator_pipes import PipeOpening
from serving.stub.pipe_reader import PipeReader
from tests.unit.test_generator_host import PipeSender, host  # noqa: F401 (the host fixture)


def test_a_board_counts_reads_per_pipe_until_the_entry_is_closed(tmp_path):
    receipts, board = Receipts(tmp_path, "tts", 2), ReceiptBoard(tmp_path)
    first, second = receipts.open(11), receipts.open(22)
    assert receipts.open(33) is None  # every entry in use
    assert (first.parameter, second.parameter) == ("tts:0", "tts:1")
    a, b = board.entry(first.parameter), board.entry(second.parameter)
    assert board.read(a, 11) == 0 and board.read(b, 22) == 0
    first.read()
    first.read()
    second.read()
    assert board.read(a, 11) == 2 and board.read(b, 22) == 1
    assert board.read(a, 22) is None  # the entry names another pipe
    first.close()
    assert board.read(a, 11) is None  # nobody reads pipe 11 any more
    first.read()  # a read still running when its stream was closed
    assert board.read(a, 11) is None
    third = receipts.open(33)  # the closed entry is reused
    assert third.parameter == "tts:0" and board.read(a, 33) == 0 and board.read(a, 11) is None
    first.read()  # ... and a late read of the old pipe does not count for the new one
    assert board.read(a, 33) == 0


def test_the_generator_never_sees_an_entry_name_another_stream_while_its_count_moves(tmp_path):
    """The generator reads the board from another process, with no lock. Counting a read once rewrote the
    whole entry with struct's pack_into, which zero-fills its target first: 9,369 of 3.7 million reads
    from another process saw id 0 for an instant ("its reader left": a pipe ended with its streams on it)."""
    import subprocess
    import sys
    import textwrap

    receipts = Receipts(tmp_path, "tts", 4)
    receipt = receipts.open(12345)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from serving.flow.receipts import ReceiptBoard
            entry = ReceiptBoard({str(tmp_path)!r}).entry({receipt.parameter!r})
            print("ready", flush=True)
            other = reads = 0
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                reads += 1
                other += ReceiptBoard.read(entry, 12345) is None
            print(other, reads)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert reader.stdout.readline().strip() == "ready"
    while reader.poll() is None:
        receipt.read()  # the count moves all the while the other process reads
    other, reads = (int(v) for v in reader.stdout.read().split())
    assert reads > 1000 and other == 0


def test_the_generator_side_reads_only_entries_that_exist(tmp_path):
    board = ReceiptBoard(tmp_path)
    assert board.entry("") is None  # no receipt: unpaced
    assert board.entry("tts:0") is None  # no board yet: unpaced
    Receipts(tmp_path, "tts")
    assert board.entry(f"tts:{ENTRIES - 1}") is not None
    for bad in (f"tts:{ENTRIES}", "tts:-1", "tts:x", "tts"):
        with pytest.raises(ValueError, match=PARAMETER):
            board.entry(bad)
    with pytest.raises(ValueError, match="unknown sender"):
        board.entry("voices:0")
    with pytest.raises(ValueError, match="unknown sender"):
        board.entry("../x:0")


def test_a_restarted_sender_voids_its_entries_and_never_shrinks_the_board(tmp_path):
    first = Receipts(tmp_path, "tts", 128).open(5)
    first.read()
    board = ReceiptBoard(tmp_path)
    entry = board.entry("tts:0")
    Receipts(tmp_path, "tts", 64)  # a new sender process (a mapped board is never cut short under a reader)
    assert board.read(entry, 5) is None and (tmp_path / "receipts-tts").stat().st_size == HEAD + 128 * 16


def test_a_board_holds_streams_until_released_and_a_restart_releases_them(tmp_path):
    """tts's pacers hold a request's streams (serving.flow.pacing); the generator reads them all in one look."""
    receipts, board = Receipts(tmp_path, "tts", 2), ReceiptBoard(tmp_path)
    assert board.held() == set()  # no board opened yet: nothing held
    board.entry("tts:0")  # the generator opens a board when a pipe names it
    receipts.hold(3)
    receipts.hold(4)
    receipts.hold(4)  # twice: one place
    big = (1 << 63) - 1  # stream ids are 63 random bits
    receipts.hold(big)
    assert board.held() == {3, 4, big}
    receipts.release(4)
    receipts.release(4)  # twice, and one never held: nothing
    receipts.release(99)
    assert board.held() == {3, big}
    from serving.config.options import MAX_SLOTS

    assert HELD >= MAX_SLOTS  # a reader holds at most its streams, one per generator slot
    for i in range(10, 10 + HELD - 2):  # every place in use
        receipts.hold(i)
    assert len(board.held()) == HELD
    with pytest.raises(IndexError):
        receipts.hold(5)
    receipts.release(3)
    receipts.hold(5)  # a released place is reused
    assert 5 in board.held() and 3 not in board.held()
    Receipts(tmp_path, "tts", 2)  # a restarted reader: its dead run's holds are void
    assert board.held() == set()


def test_the_generator_sees_whether_a_boards_reader_is_alive(tmp_path):
    import os
    import subprocess
    import sys

    here = Receipts(tmp_path, "tts").open(1)
    assert ReceiptBoard.reader_alive(ReceiptBoard(tmp_path).entry(here.parameter))
    code = f"from serving.flow.receipts import Receipts; print(Receipts({str(tmp_path)!r}, 'ensemble_generator').open(2).parameter)"
    parameter = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd()
    ).stdout.strip()
    entry = ReceiptBoard(tmp_path).entry(parameter)  # its reader exited, its entry stays
    assert ReceiptBoard.read(entry, 2) == 0 and not ReceiptBoard.reader_alive(entry)


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_reader_whose_board_is_full_opens_no_pipe(tmp_path):
    class FakeBLS:
        pb, timeout, parameters = None, 5.0, {}  # no Triton: the pipe is refused before any request

    receipts = Receipts(tmp_path, "tts", 1)
    receipts.open(1)  # its one entry in use

    async def main():
        reader = PipeReader(FakeBLS(), SideChannel(tmp_path), "generator", receipts, lambda: 7)
        with pytest.raises(StreamFailed, match="read-receipt entries are in use"):
            await reader.join(5)
        assert reader.pipe_id == 0 and not reader.readings
        reader.watcher.cancel()

    asyncio.run(main())


def stream(model, patches: int, chunk: int) -> tuple:
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    params = GenerationParams(seed=3, max_patches=patches, min_patches=patches)
    return tokens, prompt, params, ChunkSchedule(chunk, chunk, fixed=True)


def test_the_generator_sends_a_pipes_next_response_once_the_one_before_was_read(host, model):  # noqa: F811
    receipt, pipe = Receipts(host.channel.dir, "tts").open(70), PipeSender()
    host.arrivals.put(PipeOpening(70, pipe, host.receipts.entry(receipt.parameter)))
    host.arrivals.put(Arrival(7, stream(model, 12, 2), PipeSender(), 70))  # 6 chunks of 2 patches
    wait_for(lambda: 7 not in host.service.live and host.pipes.unsent() == 6)
    assert pipe.responses == [([], False)]  # the opening, not read yet: nothing more goes out
    wait_for(lambda: host.metrics.held.value == 6)  # tts_generator_held_responses
    receipt.read()  # the opening was read: what waited goes out, in one response
    wait_for(lambda: len(pipe.responses) == 2)
    assert len(pipe.chunks(7)) == 6 and pipe.chunks(7)[-1].last
    host.arrivals.put(Arrival(8, stream(model, 8, 2), PipeSender(), 70))
    wait_for(lambda: 8 not in host.service.live and host.pipes.unsent() == 4)
    assert len(pipe.responses) == 2  # the second response is not read yet
    receipt.read()
    wait_for(lambda: len(pipe.responses) == 3)
    assert len(pipe.chunks(8)) == 4 and host.pipes.unsent() == 0
    host.arrivals.put(Arrival(9, stream(model, 400, 1), PipeSender(), 70))
    wait_for(lambda: host.pipes.unsent())
    receipt.close()  # nobody reads the pipe any more: it ends, never sent unpaced, and its stream is lost
    assert pipe.done.wait(30) and pipe.responses[3:] == [(None, True)]
    wait_for(lambda: host.channel.take("lost", 9))
    wait_for(lambda: not host.service.live and not host.pipes.open and host.metrics.held.value == 0)


def test_a_pipe_whose_reader_died_is_ended_long_before_the_backstop(host, model):  # noqa: F811
    """A reader process that dies keeps its entry (nobody closes it): the generator sees its pid is gone once
    a response has waited READER_CHECK_SECONDS, and ends the pipe, its stream lost (not after 300 s)."""
    import subprocess
    import sys

    code = f"from serving.flow.receipts import Receipts; print(Receipts({str(host.channel.dir)!r}, 'tts').open(80).parameter)"
    parameter = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    pipe = PipeSender()
    host.arrivals.put(PipeOpening(80, pipe, host.receipts.entry(parameter)))
    host.arrivals.put(Arrival(8, stream(model, 400, 1), PipeSender(), 80))
    assert pipe.done.wait(60) and pipe.responses == [([], False), (None, True)]  # nothing sent unread
    wait_for(lambda: host.channel.take("lost", 8))
    wait_for(lambda: not host.service.live and not host.pipes.open)


def test_a_generator_that_closes_sends_a_held_pipe_everything(host, model):  # noqa: F811
    receipt, pipe = Receipts(host.channel.dir, "ensemble_generator").open(90), PipeSender()
    host.arrivals.put(PipeOpening(90, pipe, host.receipts.entry(receipt.parameter)))
    host.arrivals.put(Arrival(9, stream(model, 8, 2), PipeSender(), 90))
    wait_for(lambda: 9 not in host.service.live and host.pipes.unsent() == 4)
    closer = threading.Thread(target=host.close)
    closer.start()
    closer.join(60)
    assert pipe.responses[0] == ([], False) and pipe.responses[-1] == (None, True)
    assert len(pipe.responses) == 3 and len(pipe.chunks(9)) == 4 and pipe.chunks(9)[-1].last


def test_a_board_per_tts_instance(tmp_path):
    """tts with several instances (--tts-instances): a board per process, ``tts.<pid>``, named in its entries."""
    mine = Receipts(tmp_path, "tts.123", 2)
    receipt = mine.open(7)
    assert receipt.parameter == "tts.123:0" and (tmp_path / "receipts-tts.123").exists()
    assert ReceiptBoard.read(ReceiptBoard(tmp_path).entry(receipt.parameter), 7) == 0
    for bad in ("tts.x", "tts.", "voices.1"):
        with pytest.raises(ValueError, match="unknown sender"):
            Receipts(tmp_path, bad)
