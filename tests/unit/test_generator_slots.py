"""Streams wait for a generator slot in the process that sends them (serving.flow.generator_slots), never in
Triton's sequence batcher. No Triton. (A stream whose generator request Triton dropped, or the generator
lost, fails as unavailable: tests/unit/test_pipe_reader.py.)"""

from __future__ import annotations

import asyncio

import pytest

from serving.flow.generator_slots import GeneratorSlots


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


def test_the_generators_cap_holds_the_slots_below_their_number_and_lifting_it_frees_them(tmp_path):
    """The generator's step budget caps the slots (serving.stub.generator_host): a sender waits for a slot at
    the cap with slots still free, and takes one as soon as the cap is lifted (0: no cap)."""
    from serving.flow.admission import Admission
    from serving.flow.generator_slots import FILE

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
