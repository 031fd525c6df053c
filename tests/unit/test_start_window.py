"""The start window (engine.start_window): slow start clocked by first audio, halving on a late listener,
arrival order, and a simulated burst on a delivery path of fixed capacity (an injected clock, no wall time)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from engine.start_window import StartWindow


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_the_window_admits_at_once_up_to_its_size_and_the_next_start_waits():
    async def main():
        w = StartWindow(rate=16, least=2, clock=Clock())  # no start measured: 16/s x 0.25 s = 4 places
        starts = [await w.acquire() for _ in range(4)]
        fifth = asyncio.ensure_future(w.acquire())
        await asyncio.sleep(0)
        assert not fifth.done() and w.starting == 4
        starts[0].abandoned()  # a place given back without audio: the window learns nothing
        start = await asyncio.wait_for(fifth, 1)
        assert w.limit == 4 and w.starting == 4 and w.first is None
        for s in [*starts[1:], start]:
            s.delivered()
        assert w.starting == 0

    run(main())


def test_the_window_is_the_rate_times_the_least_recent_time_to_first_audio():
    """A slower step (a longer first audio) opens the window; queueing on top of the least does not."""

    async def main():
        clock = Clock()
        w = StartWindow(rate=100, least=4, clock=clock)
        assert w.limit == 25
        s = await w.acquire()
        clock.now += 0.5
        s.delivered()
        assert w.limit == 50  # 100/s x 0.5 s
        for took in (2.0, 0.3, 1.0):
            s = await w.acquire()
            clock.now += took
            s.delivered()
        assert w.base == pytest.approx(0.3) and w.limit == 30

    run(main())


def test_a_late_listener_halves_the_window_once_a_round_and_it_comes_back():
    async def main():
        clock = Clock()
        w = StartWindow(rate=160, least=4, clock=clock)  # 40 places
        s = await w.acquire()
        clock.now += 0.25
        s.delivered()
        w.played("a", 0.48)
        clock.now += 1.0  # its listener ran dry 0.52 s ago
        w.played("a", 0.0)
        assert w.late == 1 and w.limit == 20
        clock.now += 0.1
        w.played("a", 0.0)  # late again within the round (0.25 s): no second halving
        assert w.late == 2 and w.limit == 20
        w.played("b", 0.48)  # a first chunk is never late
        clock.now += 0.2
        w.played("b", 0.48)  # held 0.28 s: on time
        assert w.late == 2
        for _ in range(10):  # rounds without a late listener give the window back
            clock.now += 0.75
            s = await w.acquire()
            clock.now += 0.25
            s.delivered()
        assert w.limit == 40

    run(main())


def test_a_stream_that_waited_for_its_own_client_is_not_late():
    clock = Clock()
    w = StartWindow(rate=128, clock=clock)
    w.played("t", 0.5)
    clock.now += 10.0
    w.played("t", 0.5, counted=False)
    assert w.late == 0 and w.limit == 32


def test_waiting_starts_are_admitted_in_arrival_order_and_a_cancelled_one_leaks_no_place():
    async def main():
        w = StartWindow(rate=4, least=1, clock=Clock())  # 1 place
        first = await w.acquire()
        order: list[int] = []

        async def wait(i):
            s = await w.acquire()
            order.append(i)
            return s

        tasks = [asyncio.ensure_future(wait(i)) for i in range(4)]
        await asyncio.sleep(0)
        tasks[1].cancel()
        await asyncio.sleep(0)
        first.abandoned()
        for i in (0, 2, 3):
            (await asyncio.wait_for(tasks[i], 1)).abandoned()
        assert order == [0, 2, 3] and w.starting == 0 and not w.waiting

    run(main())


class FixedWindow:
    """The window before this one: ``places`` starts at once, whatever the step (asyncio.Semaphore)."""

    def __init__(self, places: int):
        self.places = asyncio.Semaphore(places)

    async def acquire(self):
        await self.places.acquire()
        release = self.places.release

        class Start:
            delivered = abandoned = staticmethod(release)

        return Start()

    def played(self, key, seconds, counted=True):
        pass

    def stopped(self, key):
        pass


SIZES = (3, 3, 6, 12, 24)  # patches per chunk of a 48-patch stream whose generation runs ahead (engine.chunking)


def simulate(window: StartWindow | None, clock: Clock, arrivals: int = 1024, capacity: int = 40,
             step: float = 0.08) -> dict:  # fmt: skip
    """A burst of ``arrivals`` 48-patch streams on a server whose generator makes a patch a ``step`` for every
    live stream (twice real time at 80 ms) and whose delivery path (the vocoder, the sends) carries
    ``capacity`` chunks a step, first come first served. A stream's first chunk is made 4 steps after its
    start (the prefill and 3 patches), each later one as soon as its patches are (:data:`SIZES`): a start
    costs the path a chunk every few steps, a stream that plays one every 24. ``window`` None: every stream
    starts at once."""

    async def main():
        ready: deque = deque()  # streams whose next chunk waits for the path, in the order the chunks were made
        due: dict[int, list[int]] = {}  # step -> streams whose next chunk is made then
        starts: dict[int, object] = {}
        runs_dry: dict[int, float] = {}
        sent: dict[int, int] = {}
        stalls = delivered = 0
        firsts: list[float] = []
        order: list[int] = []
        tick = 0

        async def begin(i):
            if window is not None:
                starts[i] = await window.acquire()
            order.append(i)
            made = tick + 1 + SIZES[0]
            for size in SIZES:
                due.setdefault(made, []).append(i)
                made += size

        tasks = [asyncio.ensure_future(begin(i)) for i in range(arrivals)]
        while delivered < arrivals * len(SIZES) and tick < 100_000:
            await asyncio.sleep(0)
            ready.extend(due.pop(tick, []))
            for _ in range(min(capacity, len(ready))):
                i = ready.popleft()
                now, seconds = clock.now, SIZES[sent.get(i, 0)] * 0.16
                if i in runs_dry and runs_dry[i] < now:
                    stalls += 1  # its listener ran dry
                runs_dry[i] = max(now, runs_dry.get(i, now)) + seconds
                if window is not None:
                    window.played(i, seconds)
                sent[i] = sent.get(i, 0) + 1
                delivered += 1
                if sent[i] == 1:
                    firsts.append(now)
                    if window is not None:
                        starts[i].delivered()
                if sent[i] == len(SIZES) and window is not None:
                    window.stopped(i)
            tick += 1
            clock.now = tick * step
        await asyncio.gather(*tasks)
        firsts.sort()
        return {"stalls": stalls, "first_p90": round(firsts[int(0.9 * len(firsts))], 2), "order": order,
                "chunks": delivered}  # fmt: skip

    return asyncio.run(main())


def test_a_burst_on_a_slow_step_starts_at_the_rate_and_on_a_fast_one_as_the_fixed_window():
    """1,024 streams at once. At an 80 ms step the window is the fixed 32 (the rate part, 96/s x 0.32 s, is
    smaller), so it does what the fixed window did: no stalls, first audio p90 11.5 s (the real server
    measured 10.6-11.2 s). At a 120 ms step a fixed 32 admits 67 starts a second; the window keeps 96, and
    first audio comes sooner, without stalls on a path with room."""
    results = {}
    for step in (0.08, 0.12):
        for name, window in (("fixed 32", lambda c: FixedWindow(32)), ("window", lambda c: StartWindow(clock=c))):
            clock = Clock()
            results[name, step] = simulate(window(clock), clock, capacity=400, step=step)
    print({k: {m: v for m, v in r.items() if m != "order"} for k, r in results.items()})
    for r in results.values():
        assert r["chunks"] == 1024 * len(SIZES) and r["stalls"] == 0
    assert results["window", 0.12]["order"] == list(range(1024))
    assert results["window", 0.08]["first_p90"] == results["fixed 32", 0.08]["first_p90"] > 10
    assert results["window", 0.12]["first_p90"] < results["fixed 32", 0.12]["first_p90"] / 1.3


def test_everyone_at_once_stalls_where_the_window_does_not():
    """The reason for a window at all: on a path that carries 40 chunks a step, 1,024 streams let in at once
    stall most listeners; the window stalls none."""
    clock = Clock()
    window = simulate(StartWindow(clock=clock), clock, capacity=40)
    free = simulate(None, Clock(), capacity=40)
    assert free["stalls"] > 500 and window["stalls"] == 0


def test_the_window_needs_a_rate_and_least_le_most():
    for bad in ({"rate": 0}, {"least": 0}, {"least": 9, "most": 8}):
        with pytest.raises(ValueError, match="need rate > 0 and 1 <= least <= most"):
            StartWindow(**bad)


def test_instances_of_tts_share_the_window():
    """--tts-instances N: each process's window is its share of the rate and of the least (0: none)."""
    one, two = StartWindow.of(96.0), StartWindow.of(96.0, 2)
    assert (one.rate, one.least) == (96.0, 32) and (two.rate, two.least) == (48.0, 16)
    assert StartWindow.of(96.0, 3).least == 11 and StartWindow.of(0.0, 2) is None
