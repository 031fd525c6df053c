"""serving.stub.stub_threads.Responses: a request's sends run on a thread, one at a time and in order; ``send``
returns while at most ``SENDS_AHEAD`` are queued or under way, so the caller makes its next chunk meanwhile; a
send queued goes out even when its caller is cancelled, and the final response after all of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from serving.stub.stub_threads import Responses

FINAL = 1


class Sender:
    """Records each send, the thread it ran on, and whether another send of this request overlapped it."""

    def __init__(self, seconds: float = 0.05):
        self.seconds, self.sent, self.threads, self.overlapped = seconds, [], set(), False
        self.busy = threading.Lock()

    def send(self, response=None, flags=0):
        if not self.busy.acquire(blocking=False):
            self.overlapped = True
            return
        try:
            self.threads.add(threading.get_ident())
            time.sleep(self.seconds)  # the round trip to Triton's process
            self.sent.append((response, flags))
        finally:
            self.busy.release()


def test_sends_leave_the_event_loop_free_and_go_out_in_order():
    sender, pool = Sender(), concurrent.futures.ThreadPoolExecutor(4)

    async def run():
        responses, ticks = Responses(sender, pool), 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        for i in range(3):
            await responses.send(f"chunk {i}")
        await responses.final("end", FINAL)
        ticker.cancel()
        return ticks

    ticks = asyncio.run(run())
    assert sender.sent == [("chunk 0", 0), ("chunk 1", 0), ("chunk 2", 0), ("end", FINAL)]
    assert threading.get_ident() not in sender.threads and not sender.overlapped
    assert ticks >= 10  # 4 sends of 50 ms: the loop ran its other work meanwhile (a blocked loop: 0 or 1)


def test_a_cancelled_stream_finishes_its_send_before_the_final_response():
    sender, pool = Sender(seconds=0.2), concurrent.futures.ThreadPoolExecutor(4)

    async def run():
        responses = Responses(sender, pool)

        async def stream():
            await responses.send("chunk")
            await asyncio.sleep(10)

        task = asyncio.ensure_future(stream())
        await asyncio.sleep(0.05)  # the chunk's send is under way on its thread
        task.cancel()
        await asyncio.wait({task})
        await responses.final(None, FINAL)
        return task.cancelled()

    assert asyncio.run(run())
    assert sender.sent == [("chunk", 0), (None, FINAL)] and not sender.overlapped  # the final came after it


def test_send_returns_while_few_are_queued_and_a_failed_send_is_raised_by_the_next():
    class Gated(Sender):
        """Each send waits for its own release by the test."""

        def __init__(self):
            super().__init__(seconds=0)
            self.gates = [threading.Event() for _ in range(5)]

        def send(self, response=None, flags=0):
            self.gates[len(self.sent)].wait(10)
            super().send(response, flags)

    sender, pool = Gated(), concurrent.futures.ThreadPoolExecutor(4)

    async def run():
        responses = Responses(sender, pool)  # SENDS_AHEAD: 2
        await responses.send("chunk 0")  # under way (held at its gate)
        await responses.send("chunk 1")  # queued behind it: still returns at once
        third = asyncio.ensure_future(responses.send("chunk 2"))
        await asyncio.sleep(0.05)
        assert not third.done() and sender.sent == []  # two pending: it waits for the oldest
        sender.gates[0].set()
        await asyncio.wait_for(third, 10)
        assert sender.sent == [("chunk 0", 0)]
        for gate in sender.gates[1:]:
            gate.set()
        await responses.final("end", FINAL)

    asyncio.run(run())
    assert sender.sent == [("chunk 0", 0), ("chunk 1", 0), ("chunk 2", 0), ("end", FINAL)]
    assert not sender.overlapped

    class Broken(Sender):
        def send(self, response=None, flags=0):
            if response == "chunk 0":
                raise ConnectionError("the client left")
            super().send(response, flags)

    async def broken():
        responses = Responses(Broken(0.01), pool)
        await responses.send("chunk 0")
        await asyncio.sleep(0.1)
        with pytest.raises(ConnectionError, match="the client left"):
            await responses.send("chunk 1")

    asyncio.run(broken())


def test_warm_starts_the_pool_threads_at_load():
    from serving.stub.stub_threads import BLS_THREADS, StubThreads

    threads = StubThreads("test")
    try:
        assert threads.warm(12)
        assert len(threads.pool._threads) == 12  # started now, not in a burst of streams later
        time.sleep(0.2)  # they are back waiting for work
        threads.pool.submit(time.sleep, 0).result()
        assert len(threads.pool._threads) == 12  # an idle one took it
    finally:
        threads.shutdown()
    capped = StubThreads("test")
    try:
        assert capped.warm(BLS_THREADS + 32, seconds=10)  # more than the pool holds (slots up to 1024, plus 32)
        assert len(capped.pool._threads) == BLS_THREADS
    finally:
        capped.shutdown()
