"""serving.stub.bls: ``is_cancelled()`` asked on a thread of its own, never after the request's final
response (docs/triton.md#T3), within its rate however many requests run, and the retired iterators let go by
the last question (docs/triton.md#T18)."""

import asyncio
import gc
import threading
import time
import weakref

from serving.stub import bls
from serving.stub.bls import CancelWatch, RetiredIterators


class Request:
    """Counts its is_cancelled() calls; one after ``final`` is the crash of T3."""

    def __init__(self, cancelled: bool = False, seconds: float = 0.0):
        self.cancelled, self.seconds = cancelled, seconds
        self.calls, self.final, self.after_final, self.inside = 0, False, 0, False
        self.threads: set[str] = set()

    def is_cancelled(self) -> bool:
        self.calls += 1
        self.after_final += self.final
        self.threads.add(threading.current_thread().name)
        self.inside = True
        time.sleep(self.seconds)  # a round trip to Triton's process
        self.inside = False
        return self.cancelled


async def moved_on(watch: CancelWatch, questions: int = 2) -> None:
    """Returns once the watch's thread has asked a request added now ``questions`` times: it has taken every
    earlier removal and finished every question it had under way (one thread, one question at a time), so
    a question it was ever going to ask of a removed request would have come before this returns."""
    sentinel = Request()
    entry = watch.add(sentinel)
    deadline = time.monotonic() + 30
    while sentinel.calls < questions + 1 or sentinel.inside:  # the last question over, one more after it
        assert time.monotonic() < deadline, f"the watch's thread asked {sentinel.calls} times in 30 s"
        await asyncio.sleep(0.005)
    await watch.remove(entry, last=False)


def test_a_client_that_left_is_seen_on_the_watch_thread_and_the_others_are_not():
    async def main():
        watch = CancelWatch(rate=1000, poll=0.01)
        left, stays = Request(cancelled=True), Request()
        a, b = watch.add(left), watch.add(stays)
        deadline = time.monotonic() + 2
        # each is asked in turn: under load the first may be answered before the other is asked at all
        while not (a.cancelled and stays.calls) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert a.cancelled and not b.cancelled and stays.calls >= 1
        assert left.threads == {"cancel-watch"}  # never the event loop's thread
        await watch.remove(a, last=False)
        await watch.remove(b, last=False)

    asyncio.run(main())


def test_no_question_after_remove_returns_whatever_the_timing():
    """200 requests ending at random moments while the thread asks slow questions (2 ms each): each one's
    final response, sent right after remove(), is never followed by an is_cancelled()."""

    async def one(watch, request, i):
        entry = watch.add(request)
        await asyncio.sleep((i % 17) * 0.003)
        await watch.remove(entry, last=i % 2 == 0)
        request.final = True

    async def main():
        watch = CancelWatch(rate=2000, poll=0.001)
        requests = [Request(seconds=0.002) for _ in range(200)]
        await asyncio.gather(*(one(watch, r, i) for i, r in enumerate(requests)))
        await moved_on(watch)  # the thread went on past whatever it had
        return requests

    requests = asyncio.run(main())
    assert sum(r.calls for r in requests) > 0
    assert sum(r.after_final for r in requests) == 0


def test_the_questions_stay_within_the_rate_at_any_concurrency():
    async def main():
        watch = CancelWatch(rate=200, poll=0.05)
        requests = [Request() for _ in range(300)]
        entries = [watch.add(r) for r in requests]
        await asyncio.sleep(1.0)
        calls = sum(r.calls for r in requests)
        for e in entries:
            await watch.remove(e, last=False)
        return calls

    calls = asyncio.run(main())
    assert 50 <= calls <= 200 * 1.0 + 20  # about `rate` in the second (the thread's own pace aside)


def test_the_last_question_lets_go_of_the_retired_iterators(monkeypatch):
    retired = RetiredIterators()
    monkeypatch.setattr(bls, "RETIRED", retired)

    class Iterator:
        pass

    async def main():
        watch = CancelWatch(rate=1, poll=3600)  # no poll of its own within the test
        quiet, last = Request(), Request()
        a, b = watch.add(quiet), watch.add(last)
        while not quiet.calls + last.calls or quiet.inside or last.inside:  # it asks the first one at once
            await asyncio.sleep(0.01)
        asked = quiet.calls + last.calls  # the next question is 1,800 s away (poll 3600 / 2 requests)
        iterator = Iterator()
        retired.retire(iterator)
        ref = weakref.ref(iterator)
        del iterator
        await watch.remove(a, last=False)  # no question for a request that ends broken
        assert quiet.calls + last.calls == asked and retired.held
        await watch.remove(b, last=True)
        assert last.calls >= 1 and not retired.held
        return ref

    ref = asyncio.run(main())
    gc.collect()
    assert ref() is None


def test_requests_that_end_do_not_speed_the_questions_up():
    """Removals wake the thread, but the questions keep their pace: 300 requests ending over 0.5 s
    while 300 others run, at 200 questions a second, give about 100 questions, not 400."""

    async def main():
        watch = CancelWatch(rate=200, poll=0.05)
        stay = [Request() for _ in range(300)]
        go = [Request() for _ in range(300)]
        kept = [watch.add(r) for r in stay]
        ending = [watch.add(r) for r in go]
        for e in ending:
            await watch.remove(e, last=False)
            await asyncio.sleep(0.5 / 300)
        calls = sum(r.calls for r in stay + go)
        for e in kept:
            await watch.remove(e, last=False)
        return calls

    assert asyncio.run(main()) <= 200 * 1.0 + 20  # the half second and the removals' own waits, at most ~1 s


def test_a_cancelled_remover_still_waits_for_the_thread():
    """The final response may go only once the thread let go of the request, even if the request's task is
    cancelled (a shutdown) while it waits."""

    async def main():
        watch = CancelWatch(rate=1000, poll=0.001)
        request = Request(seconds=0.2)
        entry = watch.add(request)
        while not request.calls:  # the thread is inside a slow question now
            await asyncio.sleep(0.005)
        remover = asyncio.ensure_future(watch.remove(entry, last=False))
        while not (watch.removals or entry.request is None):  # the removal is filed: the remover waits for the thread
            await asyncio.sleep(0)
        assert request.inside  # still inside its 0.2 s question: the cancel comes while the remover waits
        remover.cancel()
        try:
            await remover
        except asyncio.CancelledError:
            pass
        assert not request.inside  # the question under way ended before the remover let its caller go
        request.final = True
        assert remover.cancelled()
        await moved_on(watch)  # the thread went on past the slow question it had
        return request

    request = asyncio.run(main())
    assert request.after_final == 0
