"""Streams wait for a generator slot in the process that sends them (serving.flow.generator_slots), never in
Triton's sequence batcher; and a generator request Triton dropped before its first response is answered as
unavailable instead of holding its tts request (and admission place) for good (serving.stub.bls). No Triton."""

from __future__ import annotations

import asyncio

import pytest

from engine.lifetime import LINGERING, linger
from engine.protocol import StreamFailed
from serving.flow.generator_slots import GeneratorSlots
from serving.flow.side_channel import SideChannel
from serving.stub.bls import BLS
from serving.stub.bls_adapters import BLSGenerator


def test_slots_are_shared_across_senders_and_come_back(tmp_path):
    async def main():
        tts, ensemble = GeneratorSlots(tmp_path, "tts", 2), GeneratorSlots(tmp_path, "ensemble_generator", 2)
        await tts.take()
        await ensemble.take()
        assert tts.held() == ensemble.held() == 2
        third = asyncio.ensure_future(tts.take())
        await asyncio.sleep(0.2)
        assert not third.done()  # both slots held, whoever holds them
        ensemble.give_back()
        await asyncio.wait_for(third, 5)
        assert tts.held() == 2
        waiting = asyncio.ensure_future(tts.take())
        await asyncio.sleep(0.1)
        waiting.cancel()  # a client that leaves while it waits takes nothing
        with pytest.raises(asyncio.CancelledError):
            await waiting
        tts.give_back()
        assert tts.held() == 1
        assert GeneratorSlots(tmp_path, "ensemble_generator", 2).held() == 1  # a new one keeps tts's slot
        assert GeneratorSlots(tmp_path, "tts", 2).held() == 0  # a restarted tts: what the old one held is void

    asyncio.run(main())


@pytest.mark.parametrize("how", ["lost", "timeout"])
def test_a_generator_request_that_never_answers_fails_as_unavailable(tmp_path, how):
    """Triton dropped it unanswered (its reschedule failed): the generator marks it lost, or nothing comes
    within the BLS timeout; either way the caller is told, and its final response no longer waits for it."""
    board, stream_id = SideChannel(tmp_path), 12345

    async def main():
        generator = BLSGenerator(BLS(None, timeout=0.5 if how == "timeout" else 60.0, pool=None), board)
        lingering: set = set()
        LINGERING.set(lingering)
        started = linger(asyncio.Event().wait())  # an async_exec that never returns
        if how == "lost":
            board.mark_lost(stream_id)
        with pytest.raises(StreamFailed) as failed:
            await asyncio.wait_for(generator._started(stream_id, started), 10)
        assert failed.value.reason.startswith("unavailable: ")
        assert started not in lingering and not started.done()  # kept alive, no longer waited for
        started.cancel()

    asyncio.run(main())


def test_the_generators_cap_holds_the_slots_below_their_number_and_lifting_it_frees_them(tmp_path):
    """The generator's step budget caps the slots (serving.stub.generator_host): a sender waits for a slot at
    the cap with slots still free, and takes one as soon as the cap is lifted (0: no cap)."""
    from serving.flow.generator_slots import FILE
    from serving.flow.side_channel import Admission

    async def main():
        tts = GeneratorSlots(tmp_path, "tts", 8)
        cap = Admission(tmp_path, None, 8, file=FILE)  # as the generator opens it
        cap.set_cap(2)
        await tts.take()
        await tts.take()
        third = asyncio.ensure_future(tts.take())
        for _ in range(10):  # five polls of the waiting sender (POLL_SECONDS)
            await asyncio.sleep(0.02)
        assert not third.done() and tts.held() == 2 and cap.limit() == 2 and cap.full()
        assert not Admission(tmp_path, "ensemble_generator", 8, file=FILE).enter()  # refused at the cap, at once
        cap.set_cap(0)
        await asyncio.wait_for(third, 5)
        assert tts.held() == 3 and cap.limit() == 8
        cap.set_cap(100)  # a cap above the slots changes nothing
        assert cap.limit() == 8

    asyncio.run(main())
