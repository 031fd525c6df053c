"""Read receipts (serving.flow.receipts, docs/triton.md#T23): a sender's board counts the responses read per
stream; the generator's view sees the count, or None once the entry names another stream (closed, reused);
a read that lands after its entry was closed counts nothing; a full board opens nothing. And the generator's
engine thread (serving.stub.generator_host) sends a paced stream's next response only once the one before
was read, and everything at once when its reader closes the entry. No Triton."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.chunking import ChunkSchedule
from engine.params import GenerationParams
from serving.flow.receipts import PARAMETER, ReceiptBoard, Receipts, capacity
from serving.stub.bls import BLS, ResponseStream
from serving.stub.generator_host import Arrival
from tests.unit.test_generator_host import Sender, host  # noqa: F401 (the host fixture)


def test_a_board_counts_reads_per_stream_until_the_entry_is_closed(tmp_path):
    receipts, board = Receipts(tmp_path, "tts", 2), ReceiptBoard(tmp_path)
    first, second = receipts.open(11), receipts.open(22)
    assert receipts.open(33) is None  # every entry in use: that stream goes unpaced
    assert (first.parameter, second.parameter) == ("tts:0", "tts:1")
    a, b = board.entry(first.parameter), board.entry(second.parameter)
    assert board.read(a, 11) == 0 and board.read(b, 22) == 0
    first.read()
    first.read()
    second.read()
    assert board.read(a, 11) == 2 and board.read(b, 22) == 1
    assert board.read(a, 22) is None  # the entry names another stream
    first.close()
    assert board.read(a, 11) is None  # nobody reads stream 11 any more
    first.read()  # a read still running when its stream was closed
    assert board.read(a, 11) is None
    third = receipts.open(33)  # the closed entry is reused
    assert third.parameter == "tts:0" and board.read(a, 33) == 0 and board.read(a, 11) is None
    first.read()  # ... and a late read of the old stream does not count for the new one
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
    Receipts(tmp_path, "tts", capacity(2))
    assert board.entry("tts:63") is not None
    for bad in ("tts:64", "tts:-1", "tts:x", "tts"):
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
    assert board.read(entry, 5) is None and (tmp_path / "receipts-tts").stat().st_size == 128 * 16


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_generator_sends_a_paced_streams_next_response_once_the_one_before_was_read(host, model):  # noqa: F811
    receipts = Receipts(host.channel.dir, "tts", 4)
    receipt, sender = receipts.open(7), Sender()
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    params = GenerationParams(seed=3, max_patches=12, min_patches=12)  # 6 chunks of 2 patches
    entry = host.receipts.entry(receipt.parameter)
    host.submit(Arrival(7, (tokens, prompt, params, ChunkSchedule(2, 2, fixed=True)), sender, entry))
    wait_for(lambda: 7 not in host.service.live and (out := host.outboxes.get(7)) and out.queue[-1].last)
    out = host.outboxes[7]
    assert len(sender.chunks) == 1 and len(out.queue) == 5 and 7 in host.held  # generated, held for the reader
    wait_for(lambda: host.metrics.held.value == 5)  # tts_generator_held_responses
    receipt.read()  # the first response was read: the second goes out, and only it
    wait_for(lambda: len(sender.chunks) == 2)
    assert len(out.queue) == 4 and 7 in host.held
    receipt.read()
    wait_for(lambda: len(sender.chunks) == 3)
    receipt.close()  # nobody reads it any more: the rest goes out at once, the last one final
    assert sender.done.wait(30)
    assert len(sender.chunks) == 6 and sender.finals() == 1 and sender.chunks[-1].last
    wait_for(lambda: 7 not in host.outboxes and 7 not in host.held and host.metrics.held.value == 0)


def test_an_unpaced_stream_and_close_send_everything(host, model):  # noqa: F811
    """No receipt (a caller without one): chunks go out as they are made; a paced stream still held when the
    generator closes gets every response, its final one too."""
    prompt = model.encode_prompt(None)
    tokens = model.tokens("Hello there.", "English", prompt)
    params = GenerationParams(seed=3, max_patches=8, min_patches=8)
    free, paced = Sender(), Sender()
    receipt = Receipts(host.channel.dir, "ensemble_generator", 4).open(9)
    host.submit(Arrival(8, (tokens, prompt, params, ChunkSchedule(2, 2, fixed=True)), free))
    host.submit(Arrival(9, (tokens, prompt, params, ChunkSchedule(2, 2, fixed=True)), paced,
                        host.receipts.entry(receipt.parameter)))  # fmt: skip
    assert free.done.wait(60) and len(free.chunks) == 4 and free.finals() == 1
    wait_for(lambda: 9 not in host.service.live)
    assert len(paced.chunks) == 1
    closer = threading.Thread(target=host.close)
    closer.start()
    closer.join(60)
    assert paced.finals() == 1 and len(paced.chunks) == 4


def test_a_response_stream_reads_ahead_counts_each_read_and_closes_its_entry_once_no_read_runs(tmp_path):
    """tts's side (serving.stub.bls.ResponseStream): each response is read as soon as it is there, before
    the caller asks for it, and counted on the reading thread the moment ``next`` returned it (so the
    generator's next response need not wait for a caller that is busy); the entry is closed when the stream
    is let go of, or, with a read still waiting, once that read is back."""
    receipts, board = Receipts(tmp_path, "tts", 4), ReceiptBoard(tmp_path)
    second, third = threading.Event(), threading.Event()

    def responses():
        yield "first"
        second.wait(30)
        yield "second"
        third.wait(30)
        yield "third"

    async def until(condition):
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("timed out")

    async def main():
        with ThreadPoolExecutor(2) as pool:
            bls = BLS(None, timeout=60.0, pool=pool)
            receipt = receipts.open(21)
            entry = board.entry(receipt.parameter)
            stream = ResponseStream(bls, "generator", responses(), receipt)
            assert await stream.next() == "first" and board.read(entry, 21) == 1
            second.set()
            await until(lambda: board.read(entry, 21) == 2)  # read (and counted) before anyone asked
            assert list(stream.ahead) == ["second"]
            assert await stream.next() == "second"
            waiting = asyncio.ensure_future(stream.next())
            await asyncio.sleep(0.05)
            waiting.cancel()  # the read goes on, on its thread
            stream.close()
            assert board.read(entry, 21) == 2  # still open: a read runs
            third.set()
            await until(lambda: board.read(entry, 21) is None)
            assert receipts.free == [3, 2, 1, 0]

    asyncio.run(main())
