"""The one owner of the limits (serving.flow.admission): places, generator slots, their waiters and the slot
cap in one shared file. Streams wait for a generator slot in the process that sends them, never in Triton's
sequence batcher. No Triton. (A stream whose generator request Triton dropped, or the generator lost, fails as
unavailable: tests/unit/test_pipe_reader.py. The places across processes: tests/unit/test_vocoder_guard.py.)"""

from __future__ import annotations

import asyncio

import pytest

from serving.flow.admission import Admission


def sender(board, model: str, slots: int) -> Admission:
    """A sender's owner as serving.stub.entry builds it at the stub's start (its slots and waiters voided)."""
    admission = Admission(board, model, 40, slots)
    admission.clear()
    return admission


def test_slots_are_shared_across_senders_and_come_back(tmp_path):
    async def main():
        tts, ensemble = sender(tmp_path, "tts", 2), sender(tmp_path, "ensemble_generator", 2)
        await tts.take_slot()
        await ensemble.take_slot()
        assert tts.slots_held() == ensemble.slots_held() == 2
        third = asyncio.ensure_future(tts.take_slot())
        await asyncio.sleep(0.2)
        assert not third.done()  # both slots held, whoever holds them
        ensemble.give_slot()
        await asyncio.wait_for(third, 5)
        assert tts.slots_held() == 2
        waiting = asyncio.ensure_future(tts.take_slot())
        await asyncio.sleep(0.1)
        waiting.cancel()  # a client that leaves while it waits takes nothing
        with pytest.raises(asyncio.CancelledError):
            await waiting
        tts.give_slot()
        assert tts.slots_held() == 1 and tts.starts_waiting() == 0
        assert sender(tmp_path, "ensemble_generator", 2).slots_held() == 1  # a new one keeps tts's slot
        assert sender(tmp_path, "tts", 2).slots_held() == 0  # a restarted tts: what the old one held is void

    asyncio.run(main())


def test_the_generators_cap_holds_the_slots_below_their_number_and_lifting_it_frees_them(tmp_path):
    """The generator's step budget caps the slots (serving.stub.generator_host): a sender waits for a slot at
    the cap with slots still free, and takes one as soon as the cap is lifted (0: no cap)."""

    async def main():
        tts = sender(tmp_path, "tts", 8)
        cap = Admission(tmp_path, None, 1, 8)  # as the generator opens it
        cap.set_cap(2)
        await tts.take_slot()
        await tts.take_slot()
        third = asyncio.ensure_future(tts.take_slot())
        for _ in range(10):  # five polls of the waiting sender (POLL_SECONDS)
            await asyncio.sleep(0.02)
        assert not third.done() and tts.slots_held() == 2 and cap.limit() == 2 <= cap.slots_held()
        assert cap.free_slots() == 0  # read-ahead sees none free at the cap either
        assert not Admission(tmp_path, "ensemble_generator", 40, 8).try_slot()  # refused at the cap, at once
        cap.set_cap(0)
        await asyncio.wait_for(third, 5)
        assert tts.slots_held() == 3 and cap.limit() == 8 and cap.free_slots() == 5
        cap.set_cap(100)  # a cap above the slots changes nothing
        assert cap.limit() == 8

    asyncio.run(main())


def test_places_and_slots_are_counted_apart_in_one_file(tmp_path):
    """A place (admission to the end) and a slot (send to the generator's end) are two counts of one file:
    a full gate takes no slot away, and a reader that only looks (prompt_encoder, the launcher) sees both."""

    async def main():
        tts = Admission(tmp_path, "tts", 2, 1)
        assert tts.enter() and tts.enter() and not tts.enter() and tts.full()
        await tts.take_slot()  # the places are full; the slot is another count
        reader = Admission(tmp_path, None, 1, create=False)
        assert reader.total() == 2 and reader.slots_held() == 1 and reader.counts() == (2, 0)
        with pytest.raises(ValueError, match="takes no place"):
            reader.enter()
        tts.leave()
        tts.give_slot()
        assert (reader.total(), reader.slots_held()) == (1, 0)

    asyncio.run(main())
    with pytest.raises(FileNotFoundError):
        Admission(tmp_path / "none", None, 1, create=False)
