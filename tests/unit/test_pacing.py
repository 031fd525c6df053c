"""The pacer (serving.flow.pacing): pause at the lead, resume at half of it, delivery only grows, the hold
bound, the table of tokens. Plain numbers: no Triton."""

from __future__ import annotations

import pytest

from engine.chunking import ChunkSchedule
from serving.flow.pacing import HOLD_ERROR, MAX_UPDATES, UNKNOWN_TOKEN, Pacer, PaceTable


def pacer(lead=8.0, hold=30.0) -> tuple[Pacer, list]:
    marks: list = []
    p = Pacer(lead, hold, lambda i: marks.append(("pause", i)), lambda i: marks.append(("resume", i)), now=0.0)
    return p, marks


def test_lead_is_two_of_the_largest_chunks():
    p, _ = pacer()
    p.token = "t" * 16  # (a request without a token keeps its infinite lead: test_the_table_starts_...)
    p.paced_by(ChunkSchedule(3, 24))
    assert p.lead == pytest.approx(7.68)
    p.paced_by(ChunkSchedule(2, 3))
    assert p.lead == pytest.approx(0.96)


def test_pauses_past_the_lead_and_resumes_below_half_of_it():
    p, marks = pacer()
    p.open(1)
    p.on_sent(8.0, 1.0)
    assert not p.paused and marks == []  # at the lead, not past it
    p.on_sent(8.5, 2.0)
    assert p.paused and marks == [("pause", 1)]
    p.open(2)  # the next segment's stream starts paused
    assert marks[-1] == ("pause", 2)
    p.took(4.6, 3.0)  # 3.9 s ahead: below half the lead
    assert not p.paused and sorted(marks[-2:]) == [("resume", 1), ("resume", 2)]
    p.close(1)
    p.on_sent(13.0, 4.0)  # 8.4 ahead
    assert p.paused and marks[-1] == ("pause", 2) and ("pause", 1) not in marks[-1:]
    p.took(6.0, 5.0)  # 7.0 ahead: stays paused (hysteresis)
    assert p.paused
    p.end()
    assert not p.paused and marks[-1] == ("resume", 2)
    assert p.pauses == 4  # two pauses, each begun and ended (the start window's excuse: engine.start_window)


def test_delivered_only_grows():
    p, _ = pacer()
    p.open(1)
    p.took(5.0, 1.0)
    p.took(0.0, 2.0)  # a late or forged lower figure changes nothing
    assert p.delivered == 5.0 and p.progress == 1.0
    p.on_sent(13.0, 3.0)
    assert not p.paused  # 8.0 ahead
    p.took(1e9, 4.0)  # a forged huge figure: unpaced, never stalled
    p.on_sent(20.0, 5.0)
    assert not p.paused


def test_hold_bound_counts_from_the_pause_or_the_last_delivery():
    p, _ = pacer(lead=1.0, hold=30.0)
    p.open(1)
    p.on_sent(2.0, 10.0)
    assert p.paused and not p.expired(39.0)
    p.took(1.2, 35.0)  # progress, but still 0.8 ahead: paused, the hold counts anew
    assert p.paused and not p.expired(64.0) and p.expired(65.5)
    assert p.failure == HOLD_ERROR.format(hold=30.0) and "took no audio for 30 s" in p.failure
    q, _ = pacer(lead=1.0, hold=30.0)
    q.on_sent(2.0, 10.0)
    assert q.expired(40.5)
    unpaced, _ = pacer()
    assert not unpaced.expired(1e6)  # a request that is not paused never expires


def test_updates_are_bounded():
    table, token = PaceTable(30.0, print, print), "t" * 16
    p = table.start({"pace": token}, 0.0)
    for k in range(MAX_UPDATES):
        assert table.answer({"pace": token, "delivered": float(k)}, 0.0) is None
    assert "at most" in table.answer({"pace": token, "delivered": 1e6}, 0.0) and p.delivered == MAX_UPDATES - 1


def test_table_refuses_a_token_in_use_and_names_an_unknown_one():
    table, (b, _) = PaceTable(30.0, print, print), pacer()
    token = "t" * 16
    a = table.start({"pace": token}, 0.0)
    with pytest.raises(ValueError, match="in use by a running request"):
        table.start({"pace": token}, 0.0)
    assert table.answer({"pace": token, "delivered": 2.5}, 1.0) is None
    assert a.delivered == 2.5
    assert table.answer({"pace": "u" * 16, "delivered": 2.5}, 1.0) == UNKNOWN_TOKEN and a.delivered == 2.5
    for bad in (-1, "2", float("nan"), True, None):
        assert "parameter delivered must be a number" in table.answer({"pace": token, "delivered": bad}, 1.0)
    b.token = token
    table.end(b)  # not its entry: kept
    assert table.pacers == {token: a}
    table.end(a)
    assert table.pacers == {}


def test_tokens():
    table = PaceTable(30.0, print, print)
    for good in ("A" * 16, "a-b_c" * 12 + "abcd"):
        assert table.start({"pace": good}, 0.0).token == good
    for bad in ("short", "x" * 65, "has space in it!!", 1234567890123456789):
        with pytest.raises(ValueError, match="16-64 characters"):
            table.start({"pace": bad}, 0.0)
    assert table.start({"pace": None}, 0.0).token == ""  # no token: unpaced


def test_a_request_held_out_stays_held_out():
    p, _ = pacer(lead=1.0, hold=5.0)
    p.on_sent(2.0, 0.0)
    assert p.expired(6.0) and p.held_out
    p.end()  # its streams resume to end (cancelled): it is still the hold that ended it
    assert p.expired(7.0)


def test_the_table_starts_paced_and_unpaced_requests_and_ends_them():
    from serving.intake.requests import TTSInputs, parse_request

    marks: list = []
    table = PaceTable(30.0, lambda i: marks.append(("pause", i)), lambda i: marks.append(("resume", i)))
    unpaced = table.start({"max_patches": 5}, 0.0)
    unpaced.paced_by(ChunkSchedule(3, 24))
    unpaced.open(1)
    unpaced.on_sent(1e6, 1.0)  # never paused: it has no token, its lead stays infinite
    assert not unpaced.paused and table.pacers == {} and marks == []
    paced = table.start({"pace": "p" * 20}, 0.0)
    paced.paced_by(ChunkSchedule(3, 24))
    assert paced.lead == pytest.approx(7.68) and table.pacers == {"p" * 20: paced}
    with pytest.raises(ValueError, match="in use"):
        table.start({"pace": "p" * 20}, 0.0)
    with pytest.raises(ValueError, match="16-64"):
        table.start({"pace": "short"}, 0.0)
    paced.open(2)
    paced.on_sent(8.0, 1.0)
    assert table.answer({"pace": "p" * 20, "delivered": 1.0}, 2.0) is None and marks == [("pause", 2)]
    assert "no running request" in table.answer({"pace": "q" * 20, "delivered": 1.0}, 2.0)
    table.end(paced)  # the request is over: its mark goes, its token is free
    table.end(unpaced)
    assert marks[-1] == ("resume", 2) and table.pacers == {}
    # the token is no speech parameter: parse_request drops it (an unknown one would be refused)
    inputs = TTSInputs(text="x", parameters='{"pace": "pppppppppppppppppppp", "steps": 3}')
    assert parse_request(inputs).utterance.params.steps == 3


def test_made_counts_before_it_is_sent_and_a_caught_up_client_resumes():
    """Chunks tts has had from the generator count at once (a backlog before the sends hides nothing); at a
    speed of 2 a second of speech is half a second of audio; a client that took all it was sent resumes."""
    p, marks = pacer(lead=2.0)
    p.token = "t" * 16
    p.paced_by(ChunkSchedule(3, 6), speed=2.0)
    assert p.lead == pytest.approx(1.92)
    p.open(1)
    p.on_made(3.84, 1.0)  # 1.92 s of audio: at the lead
    assert not p.paused
    p.on_made(0.48, 1.1)
    assert p.paused and marks == [("pause", 1)]
    p.on_sent(0.5, 1.2)
    p.took(0.4, 1.3)  # 1.76 ahead of what was taken, of which 0.1 s was sent: paused
    assert p.paused
    p.took(0.5, 1.4)  # it took all it was sent: what it waits for is on its way
    assert not p.paused and marks[-1] == ("resume", 1)


def test_tts_instances_share_the_board_of_paced_requests(tmp_path):
    """Two instances (serving.flow.pace_board): a token is in use in one at a time, a pace request counts in
    whichever takes it, its bound is the request's, and the owner resumes on what the other took."""
    import asyncio

    from serving.flow.pace_board import POLL_SECONDS, PaceBoard
    from serving.flow.pacing import TOO_MANY

    async def run():
        marks: list = []
        a = PaceTable(30.0, lambda i: marks.append(("pause", i)), lambda i: marks.append(("resume", i)),
                      PaceBoard(tmp_path))  # fmt: skip
        b = PaceTable(30.0, print, print, PaceBoard(tmp_path))
        token = "s" * 16
        paced = a.start({"pace": token}, 0.0)
        with pytest.raises(ValueError, match="in use"):
            b.start({"pace": token}, 0.0)
        paced.paced_by(ChunkSchedule(3, 24))  # a lead of 7.68 s
        paced.open(1)
        paced.on_sent(8.0, 1.0)
        assert marks == [("pause", 1)]
        assert b.answer({"pace": token, "delivered": 7.5}, 2.0) is None  # (the other instance)
        await asyncio.sleep(3 * POLL_SECONDS)
        assert paced.delivered == 7.5 and marks == [("pause", 1), ("resume", 1)]
        assert a.answer({"pace": token, "delivered": 7.0}, 2.0) is None and paced.delivered == 7.5  # only growth
        assert b.answer({"pace": "u" * 16, "delivered": 1.0}, 2.0) == UNKNOWN_TOKEN
        for k in range(MAX_UPDATES - 2):
            assert (a, b)[k % 2].answer({"pace": token, "delivered": 8.0}, 3.0) is None
        assert b.answer({"pace": token, "delivered": 9.0}, 3.0) == TOO_MANY
        a.end(paced)  # its token is free in both
        assert b.answer({"pace": token, "delivered": 9.0}, 3.0) == UNKNOWN_TOKEN
        b.end(b.start({"pace": token}, 4.0))
        await asyncio.sleep(3 * POLL_SECONDS)
        assert a.poller is None and b.poller is None  # no paced request runs: nobody polls

    asyncio.run(run())
