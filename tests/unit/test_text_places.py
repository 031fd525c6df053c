"""When a text-in stream holds an admission place (serving.flow.admission), without Triton: pieces go in through
``take_piece`` as tts hands them over, the tiny model speaks them through the orchestrator, and a counting gate
says what is held. Whitespace takes nothing; text takes a place that goes back once it is spoken; a full gate,
a failure or a cancel leaves nothing held; the open streams and their lifetime are bounded."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from engine.orchestrator import Utterance
from engine.params import GenerationParams
from engine.protocol import Unavailable
from serving.flow.admission import Place, TextPlace
from serving.intake.text_streams import TextStreams, start_stream, take_piece
from tests.unit.test_orchestrator import ONES, Pipeline

START, END = 1, 2


class FakePB:
    """Just enough of triton_python_backend_utils for take_piece."""

    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = START
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = END

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.tensors.get(name)


class Tensor:
    def __init__(self, name: str, value):
        self._name, self.value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self.value


class PieceRequest:
    def __init__(self, text: str | None, flush=None, start=False, end=False):
        self.tensors = {}
        if text is not None:
            self.tensors["TEXT"] = Tensor("TEXT", np.array([text.encode()], dtype=object))
        if flush is not None:
            self.tensors["FLUSH"] = Tensor("FLUSH", np.array([flush]))
        self._flags = (START if start else 0) | (END if end else 0)

    def flags(self) -> int:
        return self._flags

    def inputs(self):
        return list(self.tensors.values())


class CountingGate:
    """The admission gate's counts, in memory (serving.flow.admission.Admission's rule)."""

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, 0

    def enter(self) -> bool:
        if self.held >= self.capacity:
            return False
        self.held += 1
        return True

    def leave(self) -> None:
        assert self.held > 0, "a place given back twice"
        self.held -= 1

    def busy_message(self) -> str:
        return f"server busy: {self.held} requests are running or waiting (limit {self.capacity}); retry shortly"


class Gauges:
    def __init__(self):
        self.in_flight = self.waiting = 0

    def count(self, in_flight: int, waiting: int) -> None:
        self.in_flight += in_flight
        self.waiting += waiting
        assert self.in_flight >= 0 and self.waiting >= 0

    @property
    def values(self) -> tuple[int, int]:
        return self.in_flight, self.waiting


def table(gate, gauges, **kw) -> TextStreams:
    return TextStreams(60, place=lambda: TextPlace(Place(gate, gauges.count)), **kw)


def send(streams, key, text="", flush=False, end=False) -> str | None:
    return take_piece(FakePB, streams, PieceRequest(text, flush, end=end), key)


def test_a_place_and_its_gauges_are_taken_and_given_together():
    gate, gauges = CountingGate(1), Gauges()
    place = Place(gate, gauges.count)
    assert place.take() and place.take() and (gate.held, gauges.values) == (1, (1, 1))  # taken once
    assert not Place(gate, gauges.count).take() and gauges.values == (1, 1)  # full: nothing counted
    place.audio()
    place.audio()
    assert gauges.values == (1, 0)
    place.give()
    place.give()  # safe to repeat
    assert (gate.held, gauges.values) == (0, (0, 0))
    assert place.take() and gauges.values == (1, 1)  # waits anew once taken anew
    place.give()
    assert (gate.held, gauges.values) == (0, (0, 0))  # given back before any audio: waiting undone too


def test_whitespace_takes_no_place_text_takes_one_and_a_full_gate_fails_the_stream():
    gate, gauges = CountingGate(1), Gauges()
    streams = table(gate, gauges)
    stream, error = start_stream(FakePB, streams, PieceRequest(" ", start=True), 1)
    assert error is None
    for space in (" ", "\n", "\t ", "\u3000", ""):
        assert send(streams, 1, space) is None
    assert (gate.held, gauges.values) == (0, (0, 0))
    assert send(streams, 1, "Hello.") is None and (gate.held, gauges.values) == (1, (1, 1))

    other, _ = start_stream(FakePB, streams, PieceRequest("", start=True), 2)
    assert send(streams, 2, "   ") is None  # no place needed
    busy = send(streams, 2, "Me too.")
    assert busy.startswith("unavailable: server busy") and other.failure == busy
    assert "has ended" in send(streams, 2, "More.")  # the stream is over; its audio request ends with `busy`
    assert gate.held == 1
    streams.close(other)
    streams.close(stream)
    assert (gate.held, gauges.values) == (0, (0, 0))


def test_a_start_with_text_takes_a_place_and_one_refused_leaves_nothing():
    gate, gauges = CountingGate(1), Gauges()
    streams = table(gate, gauges)
    stream, error = start_stream(FakePB, streams, PieceRequest("Hi.", start=True), 1)
    assert error is None and gate.held == 1
    _, busy = start_stream(FakePB, streams, PieceRequest("Hi.", start=True), 2)
    assert busy.startswith("unavailable: server busy") and 2 not in streams.open
    streams.close(stream)
    for key in range(3, 13):  # refused STARTs (issue 47, row 7): a FLUSH that is not a BOOL
        _, error = start_stream(FakePB, streams, PieceRequest("Hi.", flush=3, start=True), key)
        assert error.startswith("invalid: FLUSH must be a BOOL")
    assert (gate.held, gauges.values, streams.open) == (0, (0, 0), {})


def test_the_open_streams_are_bounded():
    gate, gauges = CountingGate(1), Gauges()
    streams = table(gate, gauges, max_open=2)
    first, _ = start_stream(FakePB, streams, PieceRequest(" ", start=True), 1)
    start_stream(FakePB, streams, PieceRequest(" ", start=True), 2)
    _, error = start_stream(FakePB, streams, PieceRequest(" ", start=True), 3)
    assert error == "unavailable: too many open text streams (2, limit 2); end a stream or retry shortly"
    with pytest.raises(Unavailable):
        streams.start(4)
    streams.close(first)
    assert start_stream(FakePB, streams, PieceRequest(" ", start=True), 3)[1] is None


def test_a_stream_open_past_its_lifetime_fails_by_name_though_pieces_keep_coming():
    streams = TextStreams(idle_seconds=1, max_seconds=0.3)
    stream = streams.start(1)

    async def go():
        async def spaces():
            for _ in range(40):
                stream.add(" ", False, False)
                await asyncio.sleep(0.05)

        feeder = asyncio.ensure_future(spaces())
        try:
            with pytest.raises(ValueError, match=r"open for over 0.3 s without its end"):
                async for _ in stream.read():
                    pass
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, ValueError):
                await feeder

    asyncio.run(asyncio.wait_for(go(), 10))


class Speaker:
    """One text stream spoken by the orchestrator as tts runs it: audio marks the place as no longer
    waiting, and the request's end closes the stream."""

    def __init__(self, model, gate, gauges, **fields):
        self.p = Pipeline(model)
        self.streams = table(gate, gauges)
        self.stream, error = start_stream(FakePB, self.streams, PieceRequest(" ", start=True), 1)
        assert error is None
        params = GenerationParams(seed=1, **fields)
        self.utterance = Utterance("", params=params, schedule=ONES, split_tokens=8)
        self.flushed, self.audio = asyncio.Event(), asyncio.Event()

    async def run(self) -> None:
        place = self.stream.place
        try:
            run = self.p.orchestrator.run_text(self.utterance, None, self.stream.read(), "flush", place.idle)
            async with contextlib.aclosing(run) as pieces:
                async for piece in pieces:
                    if piece.audio.size:
                        place.place.audio()
                        self.audio.set()
                    if piece.flushed:
                        self.flushed.set()
                    await asyncio.sleep(0)  # the local generator steps on this loop
        finally:
            self.streams.close(self.stream)


async def until(condition, seconds=20.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the time")


def test_a_stream_holds_its_place_while_it_speaks_and_gives_it_back_when_idle(model):
    gate, gauges = CountingGate(2), Gauges()
    s = Speaker(model, gate, gauges, min_patches=4, max_patches=4)

    async def go():
        task = asyncio.ensure_future(s.run())
        assert send(s.streams, 1, "The first sentence is here.") is None and gate.held == 1
        await asyncio.sleep(0.05)
        assert gate.held == 1  # no flush yet (RELEASE flush): the text waits for its cut, holding its place
        assert send(s.streams, 1, "", flush=True) is None
        await asyncio.wait_for(s.audio.wait(), 60)
        assert gauges.values == (1, 0)
        await asyncio.wait_for(s.flushed.wait(), 60)
        await until(lambda: gate.held == 0)  # spoken: given back, the stream still open
        assert gauges.values == (0, 0) and s.p.live == (0, 0)  # and no generator slot or vocoder stream held
        for _ in range(5):
            assert send(s.streams, 1, "  ") is None
        await asyncio.sleep(0.05)
        assert gate.held == 0
        s.audio.clear()
        assert send(s.streams, 1, "A second one.", flush=True, end=True) is None and gauges.values == (1, 1)
        await asyncio.wait_for(task, 60)
        assert s.audio.is_set()

    asyncio.run(go())
    assert (gate.held, gauges.values, s.p.live) == (0, (0, 0), (0, 0))


def test_text_that_cleans_to_nothing_gives_its_place_back_at_its_flush(model):
    gate, gauges = CountingGate(2), Gauges()
    s = Speaker(model, gate, gauges)

    async def go():
        task = asyncio.ensure_future(s.run())
        assert send(s.streams, 1, "😀 *", flush=True) is None and gate.held == 1  # not whitespace: a place
        await asyncio.wait_for(s.flushed.wait(), 60)
        await until(lambda: gate.held == 0)
        assert send(s.streams, 1, "", end=True) is None
        await asyncio.wait_for(task, 60)

    asyncio.run(go())
    assert (gate.held, gauges.values) == (0, (0, 0))


def test_a_cancelled_stream_gives_its_place_back(model):
    gate, gauges = CountingGate(2), Gauges()
    s = Speaker(model, gate, gauges, min_patches=40, max_patches=40)

    async def go():
        task = asyncio.ensure_future(s.run())
        assert send(s.streams, 1, "Say this for a while.", flush=True) is None
        await asyncio.wait_for(s.audio.wait(), 60)
        assert gate.held == 1 and s.p.live[0] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: s.p.live == (0, 0))  # the orchestrator's cleanup is shielded: just after

    asyncio.run(go())
    assert (gate.held, gauges.values) == (0, (0, 0))
    assert "no open text stream" in send(s.streams, 1, "More.")


def test_a_failed_stream_gives_its_place_back(model):
    gate, gauges = CountingGate(2), Gauges()
    s = Speaker(model, gate, gauges, min_patches=40, max_patches=40)

    async def go():
        task = asyncio.ensure_future(s.run())
        assert send(s.streams, 1, "Say this for a while.", flush=True) is None
        await asyncio.wait_for(s.audio.wait(), 60)
        assert "characters" in send(s.streams, 1, "x" * 5000)  # over a piece's bound: the stream fails
        with pytest.raises(ValueError, match="characters"):
            await asyncio.wait_for(task, 60)

    asyncio.run(go())
    assert (gate.held, gauges.values, s.p.live) == (0, (0, 0), (0, 0))
