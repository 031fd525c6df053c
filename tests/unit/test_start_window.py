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
             step: float = 0.08, busy=None, per_step: float = 0.0) -> dict:  # fmt: skip
    """A burst of ``arrivals`` 48-patch streams on a server whose generator makes a patch a ``step`` for every
    live stream (twice real time at 80 ms) and whose delivery path (the vocoder, the sends) carries
    ``capacity`` chunks a step, first come first served. A stream's first chunk is made 4 steps after its
    start (the prefill and 3 patches), each later one as soon as its patches are (:data:`SIZES`): a start
    costs the path a chunk every few steps, a stream that plays one every 24. ``window`` None: every stream
    starts at once; ``busy``: a PathBusy told of each chunk carried; ``per_step``: arrivals a step (0: all at
    once)."""

    async def main():
        ready: deque = deque()  # streams whose next chunk waits for the path, in the order the chunks were made
        due: dict[int, list[int]] = {}  # step -> streams whose next chunk is made then
        starts: dict[int, object] = {}
        runs_dry: dict[int, float] = {}
        sent: dict[int, int] = {}
        stalls = delivered = 0
        firsts: list[float] = []
        order: list[int] = []
        arrived: dict[int, float] = {}
        tick = 0

        async def begin(i):
            while per_step and tick < i / per_step:
                await asyncio.sleep(0)
            arrived[i] = clock.now
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
                if busy is not None:
                    busy.carried += 1
                if sent[i] == 1:
                    firsts.append(now - arrived[i])
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


def test_a_burst_starts_at_the_rate_whatever_the_step_where_a_fixed_window_slows_with_the_step():
    """1,024 streams at once on a path with room (400 chunks a step). A fixed 32 places admits 32 / 4 steps
    starts a second: first audio p90 11.5 s at an 80 ms step (the real server measured 10.6-11.2 s), 17 s at
    120 ms. The window's places follow the step (256/s x the time to first audio), so first audio comes about
    as soon at either step, without stalls, in arrival order."""
    results = {}
    for step in (0.08, 0.12):
        for name in ("fixed 32", "window"):
            clock = Clock()
            busy = PathBusy(clock, 400, step)
            window = FixedWindow(32) if name == "fixed 32" else StartWindow(clock=clock, busy=busy)
            results[name, step] = simulate(window, clock, capacity=400, step=step, busy=busy)
    print({k: {m: v for m, v in r.items() if m != "order"} for k, r in results.items()})
    for r in results.values():
        assert r["chunks"] == 1024 * len(SIZES) and r["stalls"] == 0
    assert results["window", 0.12]["order"] == list(range(1024))
    assert results["fixed 32", 0.08]["first_p90"] > 10
    for step in (0.08, 0.12):
        assert results["window", step]["first_p90"] < results["fixed 32", step]["first_p90"] / 2


def test_everyone_at_once_stalls_where_the_window_does_not():
    """The reason for a window at all: on a path that carries 40 chunks a step, 1,024 streams let in at once
    stall most listeners; the window (its places, then its pace) stalls none."""
    clock = Clock()
    busy = PathBusy(clock, 40, 0.08)
    window = simulate(StartWindow(clock=clock, busy=busy), clock, capacity=40, busy=busy)
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


class PathBusy:
    """The simulated way out's busy share since the last reading: chunks carried over what it could carry."""

    def __init__(self, clock: Clock, capacity: int, step: float):
        self.clock, self.per_second, self.carried, self.since = clock, capacity / step, 0, 0.0

    def __call__(self) -> float:
        seconds, self.since = self.clock.now - self.since, self.clock.now
        busy, self.carried = self.carried / max(seconds * self.per_second, 1e-9), 0
        return min(busy, 1.0)


def test_the_cpus_pace_the_starts_where_the_places_alone_would_stall_listeners():
    """Arrivals at 150 a second on a path that carries 100 starts a second (40 chunks a step, 5 a stream): a
    window of places alone (256/s x the time to first audio) lets in whoever arrives and stalls listeners once
    the path fills; reading how busy the path is paces the starts, and none stall."""
    results = {}
    for name in ("rate alone", "busy"):
        clock = Clock()
        busy = PathBusy(clock, 40, 0.08) if name == "busy" else None
        w = StartWindow(rate=256, clock=clock, busy=busy)
        results[name] = simulate(w, clock, arrivals=2048, capacity=40, busy=busy, per_step=12)
    print({k: {m: v for m, v in r.items() if m != "order"} for k, r in results.items()})
    assert results["rate alone"]["stalls"] > 100 and results["busy"]["stalls"] == 0


def test_below_what_the_path_carries_the_pace_lets_arrivals_straight_in():
    """Arrivals at 50 a second on the same path (half of what it carries, within TARGET_BUSY): first audio
    within its 4 steps + 1 for nine in ten."""
    clock = Clock()
    busy = PathBusy(clock, 40, 0.08)
    r = simulate(StartWindow(rate=256, clock=clock, busy=busy), clock, arrivals=2048, capacity=40, busy=busy,
                 per_step=4)  # fmt: skip
    assert r["stalls"] == 0 and r["first_p90"] <= 5 * 0.08


def test_the_pace_holds_starts_beyond_it_for_the_rest_of_the_second():
    async def main():
        clock = Clock()
        w = StartWindow(rate=10_000, clock=clock, busy=lambda: 0.7)
        for i in range(99):  # 99 one-chunk segments, then a reading half a second in: 200 chunks a second
            w.played(i, 0.1)
            w.stopped(i)
        clock.now = 0.5
        w.played("x", 0.1)  # a chunk a second costs 0.7 / 200: pace = 0.7 (TARGET_BUSY) / (0.0035 x 1) = 200
        assert w.pace == pytest.approx(200)
        starts = [await w.acquire() for _ in range(200)]
        held = asyncio.ensure_future(w.acquire())
        await asyncio.sleep(0)
        assert not held.done() and len(w.waiting) == 1 and w.starting == 200 < w.limit
        clock.now = 1.5  # the second has passed: the timer lets it in
        (await asyncio.wait_for(held, 5)).delivered()
        for s in starts:
            s.delivered()

    run(main())


def test_busy_is_the_larger_of_this_process_and_the_machine_without_niced_work(tmp_path):
    from engine.start_window import Busy

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 50 100 800 0 0 0 0 0 0\ncpu0 ...\n")
    cpu, wall = [0.0], [0.0]
    busy = Busy(str(stat), process=lambda: cpu[0], wall=lambda: wall[0])
    stat.write_text("cpu  700 500 100 900 0 0 0 0 0 0\n")  # 1,150 ticks: 600 busy, 450 niced, 100 idle
    cpu[0], wall[0] = 0.25, 1.0
    assert busy() == pytest.approx(600 / 1150)
    stat.write_text("cpu  700 500 100 1900 0 0 0 0 0 0\n")  # the machine idle, this process a core's 0.75
    cpu[0], wall[0] = 1.0, 2.0
    assert busy() == pytest.approx(0.75)
    stat.write_text("garbage")  # unreadable: this process alone
    cpu[0], wall[0] = 1.5, 3.0
    assert busy() == pytest.approx(0.5)
