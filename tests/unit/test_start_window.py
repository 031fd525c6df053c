"""The start window (engine.start_window): growth clocked by first audio, backing off on a late listener (not
one its own client paused), arrival order, and a simulated burst on a delivery path of fixed capacity (an injected
clock, no wall time)."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from contextvars import copy_context

import pytest

from engine.start_window import BASE_STARTS, CLIENT_PAUSES, StartWindow


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
        assert w.limit == 4 and w.starting == 4 and not w.recent
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


def rounds(w: StartWindow, clock: Clock, ways, busy: int = 0) -> None:
    """One round per entry of ``ways`` (a chunk's way out, s), each a base long, with ``busy`` starts waiting."""
    for way in ways:
        w.busy = max(w.busy, busy)
        clock.now += w.base
        w.carried(way)


def test_a_clear_lag_in_which_starts_waited_grows_the_window_and_one_without_does_not():
    clock = Clock()
    w = StartWindow(rate=128, least=32, clock=clock)  # 32 places (128/s x 0.25 s)
    rounds(w, clock, [0.003] * 7, busy=32)  # a lag (6 rounds) without a queue, the window full, nobody waiting
    assert w.limit == 32
    rounds(w, clock, [0.003] * 6, busy=40)  # starts waited in the lag: x1.2
    assert w.gain == pytest.approx(1.2) and w.limit == 39
    rounds(w, clock, [0.003] * 6, busy=40)
    assert w.limit == 47
    rounds(w, clock, [0.012] * 6, busy=60)  # the ways out wait 9 ms beyond the floor (over 5): it holds
    assert w.limit == 47 and w.congested == 0


def test_a_standing_queue_gives_back_what_growth_gave_once_a_lag_and_holds_the_start():
    clock = Clock()
    w = StartWindow(rate=128, least=32, clock=clock)
    rounds(w, clock, [0.003, 0.05, 0.05] + [0.003] * 5, busy=40)  # a queue at the start: held, not grown
    assert w.congested == 2 and w.limit == 32
    rounds(w, clock, [0.003] * 12, busy=40)  # two clear lags: x1.2 twice
    assert w.limit == 47
    rounds(w, clock, [0.05])  # a round whose every chunk waited 47 ms beyond the floor: x0.7
    assert w.gain == pytest.approx(1.44 * 0.7) and w.limit == 33
    rounds(w, clock, [0.05] * 5)  # it still stands, within the lag: the starts of before are still arriving
    assert w.limit == 33
    rounds(w, clock, [0.05] * 30)  # lags later: never below the start (a late listener may take it lower)
    assert w.gain == 1.0 and w.limit == 32


def test_a_late_listener_backs_off_once_a_lag_and_the_window_grows_back_to_below_where_it_was():
    async def main():
        clock = Clock()
        w = StartWindow(rate=160, least=4, clock=clock)  # 40 places
        s = await w.acquire()
        clock.now += 0.25
        s.delivered()
        rounds(w, clock, [0.003] * 13, busy=100)  # two clear lags, starts waiting: x1.2 twice
        assert w.limit == 58
        w.played("a", 0.48)
        clock.now += 1.0  # its listener ran dry 0.52 s ago
        w.played("a", 0.0)
        assert w.late == 1 and w.gain == pytest.approx(1.44 * 0.7) and w.limit == 41
        clock.now += 0.1
        w.played("a", 0.0)  # late again within the lag (6 x 0.25 s): no second back-off
        assert w.late == 2 and w.limit == 41
        w.played("b", 0.48)  # a first chunk is never late
        clock.now += 0.2
        w.played("b", 0.48)  # held 0.28 s: on time
        assert w.late == 2
        rounds(w, clock, [0.003] * 60, busy=100)  # clear lags, starts waiting: it grows back, to 0.85 of where it was
        assert w.gain == pytest.approx(0.85 * 1.44) and w.limit == 49
        clock.now += 60.0  # a minute after the back-off it may grow past it
        rounds(w, clock, [0.003] * 7, busy=100)
        assert w.limit == 71  # grown twice: the round after the wait ends a lag, and 6 more

    run(main())


def test_the_window_stays_within_its_bounds():
    clock = Clock()
    w = StartWindow(rate=128, least=32, clock=clock)
    w.played("a", 0.0)
    for _ in range(40):
        clock.now += 2.0
        w.played("a", 0.0)  # late, each time (a slow reader of its own, maybe): never below the start
    assert w.late == 40 and w.limit == 32
    w = StartWindow(rate=128, least=32, most=100, clock=clock)
    rounds(w, clock, [0.003] * 600, busy=10_000)
    assert w.limit == 100


def test_the_base_is_the_least_of_the_last_starts_and_an_old_least_leaves():
    async def main():
        clock = Clock()
        w = StartWindow(rate=100, least=1, most=10_000, clock=clock)
        for took in [0.1] + [1.0] * BASE_STARTS + [0.5] + [2.0] * BASE_STARTS:
            s = await w.acquire()
            clock.now += took
            s.delivered()
            assert w.base == min(w.recent)
        assert w.base == 2.0

    run(main())


def test_a_stream_its_own_client_paused_is_not_late():
    """A paced request's chunk after a pause its slow client asked for gets no verdict and restarts its
    listener's clock; without pauses, the same gaps are late."""
    clock, pauses = Clock(), [0]

    def listen(w: StartWindow, key: str, paused: bool) -> None:
        for _ in range(8):  # a 0.48 s chunk every 2 s: a reader at a quarter of real time
            w.played(key, 0.48)
            clock.now += 2.0
            pauses[0] += paused

    paced, unpaced, request = StartWindow(rate=128, clock=clock), StartWindow(rate=128, clock=clock), copy_context()
    request.run(CLIENT_PAUSES.set, lambda: pauses[0])  # the paced request's context, as tts sets it
    request.run(listen, paced, "p", True)
    listen(unpaced, "u", False)
    assert paced.late == 0 and unpaced.late == 7 and unpaced.limit == paced.limit == 32
    request.run(paced.played, "p", 0.48)  # paused since its last chunk: no verdict
    clock.now += 2.0
    request.run(paced.played, "p", 0.48)  # not since: late like any
    assert paced.late == 1


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

    def played(self, key, seconds):
        pass

    def carried(self, seconds):
        pass

    def stopped(self, key):
        pass


SIZES = (3, 3, 6, 12, 24)  # patches per chunk of a 48-patch stream whose generation runs ahead (engine.chunking)


def simulate(window: StartWindow | None, clock: Clock, arrivals: list[int], capacity: int = 40,
             step: float = 0.08) -> dict:  # fmt: skip
    """48-patch streams arriving at the steps ``arrivals`` on a server whose generator makes a patch a ``step``
    for every live stream (twice real time at 80 ms) and whose delivery path (the vocoder, the sends) carries
    ``capacity`` chunks a step, first come first served, each in 5 ms when nothing queues (what the window's
    :meth:`~StartWindow.carried` hears). A stream's first chunk is made 4 steps after its start (the prefill
    and 3 patches), each later one as soon as its patches are (:data:`SIZES`): a start costs the path a chunk
    every few steps, a stream that plays one every 24. ``window`` None: every stream starts as it arrives."""

    async def main():
        ready: deque = deque()  # (stream, step made) of chunks waiting for the path, in the order they were made
        due: dict[int, list[int]] = {}  # step -> streams whose next chunk is made then
        starts, runs_dry, sent, came = {}, {}, {}, {}
        stalled: set[int] = set()
        firsts: list[float] = []
        order: list[int] = []
        delivered = tick = arrived = 0
        tasks = []

        async def begin(i):
            if window is not None:
                starts[i] = await window.acquire()
            order.append(i)
            made = tick + 1 + SIZES[0]
            for size in SIZES:
                due.setdefault(made, []).append(i)
                made += size

        while delivered < len(arrivals) * len(SIZES) and tick < 100_000:
            while arrived < len(arrivals) and arrivals[arrived] <= tick:
                came[arrived] = clock.now
                tasks.append(asyncio.ensure_future(begin(arrived)))
                arrived += 1
            await asyncio.sleep(0)
            ready.extend((i, tick) for i in due.pop(tick, []))
            for _ in range(min(capacity, len(ready))):
                i, made = ready.popleft()
                now, seconds = clock.now, SIZES[sent.get(i, 0)] * 0.16
                if i in runs_dry and runs_dry[i] < now:
                    stalled.add(i)  # its listener ran dry
                runs_dry[i] = max(now, runs_dry.get(i, now)) + seconds
                sent[i] = sent.get(i, 0) + 1
                delivered += 1
                if window is not None:
                    window.carried((tick - made) * step + 0.005)
                    window.played(i, seconds)
                    if sent[i] == 1:
                        starts[i].delivered()
                    if sent[i] == len(SIZES):
                        window.stopped(i)
                if sent[i] == 1:
                    firsts.append(now - came[i])
            tick += 1
            clock.now = tick * step
        await asyncio.gather(*tasks)
        firsts.sort()
        return {"stalled": len(stalled), "first_p90": round(firsts[int(0.9 * len(firsts))], 2), "order": order,
                "chunks": delivered}  # fmt: skip

    return asyncio.run(main())


def poisson(rate: float, seconds: float, step: float = 0.08, seed: int = 1) -> list[int]:
    """The steps at which Poisson arrivals of ``rate`` a second come in ``seconds``."""
    r, t, steps = random.Random(seed), 0.0, []
    while (t := t + r.expovariate(rate)) < seconds:
        steps.append(int(t / step))
    return steps


BURST = [0] * 1024


def test_a_burst_on_a_path_with_room_is_let_in_sooner_than_by_the_fixed_window_in_arrival_order():
    """1,024 streams at once on a path that carries all of them (400 chunks a step): the fixed 32 places let
    them in at its pace whatever the path says; the window grows while the path stays clear."""
    results = {}
    for step in (0.08, 0.12):
        for name, window in (("fixed 32", lambda c: FixedWindow(32)), ("window", lambda c: StartWindow(clock=c))):
            clock = Clock()
            results[name, step] = simulate(window(clock), clock, BURST, capacity=400, step=step)
    print({k: {m: v for m, v in r.items() if m != "order"} for k, r in results.items()})
    for r in results.values():
        assert r["chunks"] == 1024 * len(SIZES) and r["stalled"] == 0
    assert results["window", 0.12]["order"] == list(range(1024))
    for step in (0.08, 0.12):
        assert results["window", step]["first_p90"] < results["fixed 32", step]["first_p90"] / 1.3


def test_on_a_full_path_everyone_at_once_stalls_and_the_window_does_not_burst_or_at_twice_its_rate():
    """The reason for a window at all: on a path that carries 40 chunks a step (about 100 starts a second),
    1,024 streams let in at once stall most listeners, and Poisson arrivals at 192 a second stall some; the
    window stalls none, however long the line of starts grows."""
    for arrivals in (BURST, poisson(192, 20)):
        clock = Clock()
        window = simulate(StartWindow(clock=clock), clock, arrivals, capacity=40)
        free = simulate(None, Clock(), arrivals, capacity=40)
        print(len(arrivals), {k: v for k, v in window.items() if k != "order"}, free["stalled"])
        assert free["stalled"] > len(arrivals) / 50 and window["stalled"] == 0


def test_the_window_needs_a_rate_and_least_le_most():
    for bad in ({"rate": 0}, {"least": 0}, {"least": 9, "most": 8}):
        with pytest.raises(ValueError, match="need rate > 0 and 1 <= least <= most"):
            StartWindow(**bad)


def test_instances_of_tts_share_the_window():
    """--tts-instances N: each process's window is its share of the rate and of the least (0: none)."""
    one, two = StartWindow.of(96.0), StartWindow.of(96.0, 2)
    assert (one.rate, one.least) == (96.0, 32) and (two.rate, two.least) == (48.0, 16)
    assert StartWindow.of(96.0, 3).least == 11 and StartWindow.of(0.0, 2) is None
