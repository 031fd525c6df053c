"""serving.stub.bls.RetiredIterators: a retired BLS response iterator is let go of only after an ``is_cancelled()``
that went through the stub's queue (returned False) began after it was retired (docs/triton.md#T18)."""

import asyncio
import gc
import weakref

import pytest

from serving.stub.bls import RetiredIterators


class Iterator:  # stands in for the stub's ResponseIterator: all that matters is who holds it
    pass


class Request:
    def __init__(self, answers):
        self.answers = list(answers)  # what each is_cancelled() returns; an exception class is raised

    def is_cancelled(self):
        answer = self.answers.pop(0)
        if isinstance(answer, type):
            raise answer("the stub's queue failed")
        return answer


def retired_one(retired: RetiredIterators) -> weakref.ref:
    iterator = Iterator()
    retired.retire(iterator)
    return weakref.ref(iterator)


def test_let_go_after_a_round_trip_that_returned_false():
    retired = RetiredIterators()
    ref = retired_one(retired)
    gc.collect()
    assert ref() is not None  # held: the stub may still hold it too
    assert retired.is_cancelled(Request([False])) is False
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("answer", [True, RuntimeError])
def test_held_when_the_answer_may_not_have_gone_through_the_queue(answer):
    retired = RetiredIterators()
    ref = retired_one(retired)
    request = Request([answer, False])
    if isinstance(answer, type):
        with pytest.raises(RuntimeError) as raised:
            retired.is_cancelled(request)
        del raised  # its traceback holds the call's frame, and so the iterator
    else:
        assert retired.is_cancelled(request) is True  # cached by the stub once True: no round trip
    gc.collect()
    assert ref() is not None
    retired.is_cancelled(request)
    gc.collect()
    assert ref() is None


def test_watch_request_lets_go_at_the_end_of_a_request(monkeypatch):
    """A request's streams retire their iterators as they end, after its last ``is_cancelled()`` poll: once
    the request is over (``watch`` returned None), ``watch_request`` asks once more, so that they are let go of
    now, on the watch's thread, not at some later request's poll (docs/triton.md#T18)."""
    from serving.stub import bls

    retired = RetiredIterators()
    monkeypatch.setattr(bls, "RETIRED", retired)

    class Flags:  # the launcher's flags (serving.flow.side_channel.SideChannel.flag): none raised
        def flag(self, name):
            return None

    async def scenario():
        request, refs = Request([False, False]), []

        async def stream():  # ends before any poll, retiring its iterator on its way out, as a BLS stream does
            refs.append(retired_one(retired))

        task, answer = await bls.watch_request(request, stream(), Flags())
        assert task.done()
        return answer, refs[0], 2 - len(request.answers)

    answer, ref, asked = asyncio.run(scenario())
    gc.collect()
    assert answer is None and asked >= 1  # the watch's thread may have polled once before the release's question
    assert ref() is None and not retired.held
