"""serving.stub.stub_threads.Responses: a request's sends run on a thread, in order, and a send once started ends before
its caller sees a cancellation, so a final response never overtakes a chunk."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

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
        sent_when_cancelled = list(sender.sent)
        await responses.final(None, FINAL)
        return task.cancelled(), sent_when_cancelled

    cancelled, sent_when_cancelled = asyncio.run(run())
    assert cancelled and sent_when_cancelled == [("chunk", 0)]  # the task ended only once its send had
    assert sender.sent == [("chunk", 0), (None, FINAL)] and not sender.overlapped
