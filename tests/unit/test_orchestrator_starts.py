"""Starts under load (engine.orchestrator with an engine.start_window.StartWindow), without a model: at most the
window's places of utterances are between their first stream's start and their first audio; the others wait
in arrival order, and a place comes back with the first audio, or when the utterance ends, fails or is
cancelled before any. (A frozen clock: each start's time to first audio is 0, so the window stays at
``least``.)"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from engine.orchestrator import Orchestrator, Utterance
from engine.protocol import LATENT_DIM, STOP, Chunk, StreamFailed
from engine.start_window import StartWindow

SAMPLES_PER_LATENT = 960


class Prompts:
    async def encode(self, voice):
        return None


class Generator:
    """Each stream says when it starts; its first chunk comes when the test lets it (``go[text]``), and a
    stream whose text starts with "fail" fails there instead."""

    def __init__(self):
        self.started: list[str] = []
        self.go: dict[str, asyncio.Event] = {}

    async def stream(self, segment):
        self.started.append(segment.text)
        none = np.zeros((0, LATENT_DIM), np.float32)
        if segment.text.startswith("plan"):  # Instruct's design: a plan first, its audio when the test says
            yield Chunk(segment.stream_id, none, none, text="a warm low voice")
        go = self.go.setdefault(segment.text, asyncio.Event())
        await go.wait()
        if segment.text.startswith("fail"):
            yield Chunk(segment.stream_id, np.zeros((0, LATENT_DIM), np.float32), np.zeros((0, LATENT_DIM), np.float32),
                        last=True, finish_reason="error: the step failed")  # fmt: skip
            return
        latents = np.zeros((12, LATENT_DIM), np.float32)
        yield Chunk(segment.stream_id, latents, np.zeros((0, LATENT_DIM), np.float32), seq=0)
        yield Chunk(segment.stream_id, latents, np.zeros((0, LATENT_DIM), np.float32), last=True,
                    finish_reason=STOP, seq=1)  # fmt: skip


class Vocoder:
    async def decode(self, chunk):
        return np.ones(len(chunk.latents) * SAMPLES_PER_LATENT, np.float32)


def utterance(text: str) -> Utterance:
    return Utterance(text=text, language="English", normalize=False)


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


async def until(condition, seconds: float = 10.0):
    """Wait until ``condition()`` (the front end runs on a thread: arrival takes a moment)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def spoken(orchestrator, text: str) -> list:
    """Every piece of one utterance."""
    async with contextlib.aclosing(orchestrator.run(utterance(text))) as pieces:
        return [piece async for piece in pieces]


def waiting(orchestrator) -> int:
    return len(orchestrator.starts.waiting)


def window(places: int) -> StartWindow:
    """A window of ``places`` whatever the times (a frozen clock)."""
    return StartWindow(rate=4 * places, least=places, clock=lambda: 0.0)


def test_a_burst_starts_as_first_audio_goes_out_in_arrival_order():
    async def go():
        generator = Generator()
        orchestrator = Orchestrator(Prompts(), generator, Vocoder(), len, starts=window(2))
        firsts: dict[str, asyncio.Event] = {}

        async def listen(text: str):
            firsts[text] = asyncio.Event()
            async with contextlib.aclosing(orchestrator.run(utterance(text))) as pieces:
                async for piece in pieces:
                    firsts[text].set()
                    if piece.final:
                        return piece

        tasks = []
        for n, text in enumerate(("one", "two", "three", "four")):  # arriving one after the other
            tasks.append(asyncio.ensure_future(listen(text)))
            await until(lambda n=n: len(generator.started) + waiting(orchestrator) == n + 1)
        await settle()
        assert generator.started == ["one", "two"]  # the others wait for a place
        generator.go["two"].set()
        await firsts["two"].wait()
        await settle()
        assert generator.started == ["one", "two", "three"]  # two's first audio is out: the next one starts
        generator.go["one"].set()
        await settle()
        assert generator.started == ["one", "two", "three", "four"]
        for text in ("three", "four"):
            generator.go[text].set()
        finals = await asyncio.gather(*tasks)
        assert all(f.final and f.finish_reason == STOP for f in finals)
        assert orchestrator.starts.starting == 0 and orchestrator.starts.limit == 2  # every place came back

    asyncio.run(go())


def test_a_failed_or_cancelled_start_gives_its_place_back_and_a_cancelled_waiter_takes_none():
    async def go():
        generator = Generator()
        orchestrator = Orchestrator(Prompts(), generator, Vocoder(), len, starts=window(1))

        failing = asyncio.ensure_future(spoken(orchestrator, "fail first"))
        await until(lambda: generator.started == ["fail first"])
        waiter = asyncio.ensure_future(spoken(orchestrator, "cancelled while waiting"))
        await until(lambda: waiting(orchestrator) == 1)
        left = asyncio.ensure_future(spoken(orchestrator, "left"))
        await until(lambda: waiting(orchestrator) == 2)
        assert generator.started == ["fail first"]
        waiter.cancel()  # it leaves while waiting for a place: it must take none
        await until(lambda: waiting(orchestrator) == 1)
        generator.go["fail first"].set()
        with pytest.raises(StreamFailed):
            await failing
        await until(lambda: len(generator.started) == 2)
        assert generator.started == ["fail first", "left"]  # the failure gave its place back
        left.cancel()  # cancelled after its start, before its first audio
        with contextlib.suppress(asyncio.CancelledError):
            await left
        assert waiter.cancelled()
        generator.go["last"] = asyncio.Event()
        generator.go["last"].set()
        pieces = await spoken(orchestrator, "last")  # the place is free again
        assert pieces[-1].final and generator.started[-1] == "last"
        assert orchestrator.starts.starting == 0

    asyncio.run(go())


def test_a_plan_gives_the_place_back_before_its_audio():
    """An Instruct design writes its plan first, which may take many steps: its place comes back with the plan."""

    async def go():
        generator = Generator()
        orchestrator = Orchestrator(Prompts(), generator, Vocoder(), len, starts=window(1))

        design = asyncio.ensure_future(spoken(orchestrator, "plan first"))
        await until(lambda: generator.started == ["plan first"])
        other = asyncio.ensure_future(spoken(orchestrator, "other"))
        await until(lambda: generator.started == ["plan first", "other"])  # the plan is out: it started
        for text in ("plan first", "other"):
            generator.go[text].set()
        got = await design
        assert got[0].text == "a warm low voice" and got[-1].final and (await other)[-1].final
        assert orchestrator.starts.starting == 0

    asyncio.run(go())


def test_no_window_by_default():
    assert Orchestrator(Prompts(), Generator(), Vocoder(), len).starts is None


def test_the_window_watches_listeners_within_a_segment_and_forgets_them_after():
    async def go():
        generator = Generator()
        starts = window(2)
        orchestrator = Orchestrator(Prompts(), generator, Vocoder(), len, starts=starts)
        generator.go["one"] = asyncio.Event()
        generator.go["one"].set()
        pieces = await spoken(orchestrator, "one")
        assert pieces[-1].final and starts.starting == 0 and not starts.listeners and starts.late == 0

    asyncio.run(go())
