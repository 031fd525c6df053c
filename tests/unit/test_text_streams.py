"""The table of tts's text-in streams, without Triton: pieces in order, the bounds, the idle timeout, ids."""

from __future__ import annotations

import asyncio

import pytest

from engine.orchestrator import TextPiece
from serving.contract import MAX_STREAM_CHARS, MAX_STREAM_PIECES
from serving.intake.text_streams import TextStreams


def read_all(stream) -> list:
    async def go():
        return [piece async for piece in stream.read()]

    return asyncio.run(go())


def test_pieces_come_out_in_order_until_the_end():
    streams = TextStreams(idle_seconds=5)
    stream = streams.start(7)
    stream.add("Hello ", False, False)
    streams.get(7).add("there.", True, False)
    streams.get(7).add("", False, True)
    assert read_all(stream) == [TextPiece("Hello "), TextPiece("there.", True), TextPiece("")]
    with pytest.raises(ValueError, match="has ended"):
        stream.add("more", False, False)


def test_an_open_id_cannot_be_started_again_and_a_closed_one_takes_no_pieces():
    streams = TextStreams(idle_seconds=5)
    stream = streams.start("abc")
    with pytest.raises(ValueError, match="open text stream's"):
        streams.start("abc")
    streams.close(stream)
    with pytest.raises(ValueError, match="no open text stream has sequence id abc"):
        streams.get("abc")
    streams.start("abc")  # free again


def test_too_much_text_fails_the_stream():
    stream = TextStreams(idle_seconds=5).start(1)
    for _ in range(MAX_STREAM_CHARS // 4000):
        stream.add(" " * 4000, True, False)
    with pytest.raises(ValueError, match=f"over {MAX_STREAM_CHARS} characters"):
        stream.add("x", False, False)
    with pytest.raises(ValueError, match=f"over {MAX_STREAM_CHARS} characters"):  # the reader gets it too
        read_all(stream)


def test_too_many_pieces_fail_the_stream():
    stream = TextStreams(idle_seconds=5).start(1)
    for _ in range(MAX_STREAM_PIECES):
        stream.add("", False, False)
    with pytest.raises(ValueError, match=f"over {MAX_STREAM_PIECES} requests"):
        stream.add("", False, False)


def test_a_control_token_split_across_pieces_is_refused():
    stream = TextStreams(idle_seconds=5).start(1)
    with pytest.raises(ValueError, match="must not contain"):  # "<|" alone is refused already
        stream.add("Say <|eo", False, False)
    assert stream.failure and "<|" in stream.failure


def test_a_control_token_closed_in_the_next_piece_is_refused():
    stream = TextStreams(idle_seconds=5).start(1)
    stream.add("Say <", False, False)
    with pytest.raises(ValueError, match="must not contain"):
        stream.add("|eot|>", False, False)


def test_an_idle_stream_fails_by_name():
    stream = TextStreams(idle_seconds=0.05).start(1)
    stream.add("Hello", False, False)

    async def go():
        got = []
        async for piece in stream.read():
            got.append(piece)
        return got

    with pytest.raises(ValueError, match="no text for 0.05 s"):
        asyncio.run(go())
    with pytest.raises(ValueError, match="has ended"):
        stream.add("late", False, False)


def test_a_reader_cancelled_as_a_piece_arrives_is_cancelled():
    """A cancellation that comes in the same turn of the loop as the piece it waited for ends the reader
    (asyncio.wait_for on Python 3.11 returned the piece and lost the cancellation: the reader then read on
    until the stream's end or its idle timeout)."""
    stream = TextStreams(idle_seconds=5).start(1)

    async def go():
        got = []

        async def reader():
            async for piece in stream.read():
                got.append(piece)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)  # waiting for its first piece
        stream.add("Hello ", False, False)
        task.cancel()
        stream.add("there.", False, False)
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    assert asyncio.run(go()) == []
