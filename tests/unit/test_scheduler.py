"""The scheduler and the page bookkeeping, without torch: every admission path the generator model takes.

Expectations are written out by hand (which slot, which pages, which stream runs), never recomputed with
the code under test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler


def test_scheduling_imports_no_torch():
    code = "import sys, engine.scheduler, engine.block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- pages ---------------------------------------------------------------------------------------------


def test_pages_are_reserved_then_taken_as_a_stream_grows():
    blocks = BlockManager(slots=2, max_len=20, num_pages=6, page_size=4)
    assert blocks.reserve(1, 9)  # ceil(9 / 4) = 3 pages promised, none taken
    assert (blocks.committed, blocks.pages_available, blocks.pages_in_use) == (3, 3, 0)
    assert blocks.grow(1, 3) == [(0, 1)]  # pages come from the front of the free list, 1 first
    assert blocks.grow(1, 4) == []  # 4 positions still fit page 1
    assert blocks.grow(1, 9) == [(1, 2), (2, 3)]
    assert blocks.pages == [[], [1, 2, 3]] and blocks.pages_in_use == 3
    with pytest.raises(RuntimeError, match="exceed its reservation of 3 pages"):
        blocks.grow(1, 13)
    blocks.release(1)
    assert blocks.pages == [[], []] and blocks.committed == 0 and blocks.pages_in_use == 0
    assert blocks.reserve(0, 4) and blocks.grow(0, 1) == [(0, 4)]  # a freed page is reused last


def test_reservations_wait_for_free_pages_and_refuse_what_never_fits():
    blocks = BlockManager(slots=3, max_len=64, num_pages=5, page_size=4)
    assert blocks.reserve(0, 12)
    assert not blocks.reserve(1, 12)  # 3 more pages, 2 left: wait, nothing changed
    assert blocks.committed == 3 and blocks.reserved == [3, 0, 0]
    assert blocks.reserve(1, 8)
    with pytest.raises(RuntimeError, match="already holds"):
        blocks.reserve(1, 4)
    with pytest.raises(ValueError, match="needs 6 KV-cache pages of 4 positions; the whole pool has 5"):
        blocks.reserve(2, 21)
    with pytest.raises(ValueError, match="65 positions exceed the cache length 64"):
        blocks.reserve(2, 65)
    with pytest.raises(IndexError):
        blocks.reserve(3, 4)
    blocks.release(0)
    assert blocks.reserve(2, 12)


def test_the_default_pool_holds_every_slot_at_full_length():
    blocks = BlockManager(slots=4, max_len=100)  # 16-position pages: 7 per stream
    assert blocks.num_pages == 28
    for slot in range(4):
        assert blocks.reserve(slot, 100)
    assert blocks.pages_available == 0


# -- slots and the waiting queue -----------------------------------------------------------------------


def test_slots_go_in_order_and_a_freed_slot_is_reused_last():
    s = Scheduler(3)
    assert [s.admit(i, 10, 1).slot for i in (7, 8, 9)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3 generator slots are in use"):
        s.admit(10, 10, 1)
    with pytest.raises(ValueError, match="already live"):
        s.admit(8, 10, 1)
    assert s.finish(8) and not s.finish(8)
    s.finish(7)
    assert list(s.free) == [1, 0]
    assert s.admit(11, 10, 1).slot == 1


def test_a_stream_that_fits_later_waits_in_order_and_is_never_passed():
    blocks = BlockManager(slots=4, max_len=64, num_pages=6, page_size=4)
    s = Scheduler(4, blocks)
    s.admit(1, 16, 1)  # 4 pages
    s.admit(2, 12, 1)  # 3 pages: only 2 free -> waits
    s.admit(3, 4, 1)  # 1 page would fit, but never ahead of stream 2
    assert list(s.queue) == [2, 3]
    plan = s.schedule([1, 2, 3])
    assert (plan.run, plan.waiting, plan.started) == ([1], [2, 3], [])
    s.finish(1)
    plan = s.schedule([2, 3])
    assert (plan.run, plan.waiting, plan.started) == ([2, 3], [], [2, 3])
    assert blocks.reserved[1] == 3 and blocks.reserved[2] == 1  # slots 1 and 2 hold streams 2 and 3
    assert s.schedule([3]).started == []


def test_a_stream_that_can_never_fit_is_refused_and_nothing_is_kept():
    s = Scheduler(2, BlockManager(slots=2, max_len=64, num_pages=3, page_size=4))
    with pytest.raises(ValueError, match="the whole pool has 3"):
        s.admit(1, 13, 1)
    assert s.active == 0 and list(s.free) == [0, 1] and not s.queue


def test_a_stream_cancelled_while_waiting_leaves_the_queue_and_its_slot_is_free():
    blocks = BlockManager(slots=3, max_len=64, num_pages=4, page_size=4)
    s = Scheduler(3, blocks)
    for i in (1, 2, 3):
        s.admit(i, 16, 1)
    assert list(s.queue) == [2, 3]
    s.finish(2)
    assert list(s.queue) == [3] and list(s.free) == [1] and blocks.reserved == [4, 0, 0]
    s.finish(1)
    assert s.schedule([3]).run == [3] and blocks.reserved == [0, 0, 4]


def test_each_plan_takes_the_pages_its_step_writes_prefix_first_then_one_position_a_step():
    blocks = BlockManager(slots=2, max_len=64, num_pages=8, page_size=4)
    s = Scheduler(2, blocks)
    s.admit(1, 12, 5)  # a prompt of 5 positions, then up to 7 more: 3 pages reserved
    plan = s.schedule([1])
    assert plan.pages == {0: [(0, 1), (1, 2)]}  # its prompt: positions 0..4, pages 1 and 2
    assert [s.schedule([1]).pages for _ in range(4)] == [{}, {}, {}, {0: [(2, 3)]}]  # positions 5, 6, 7, 8
    s.admit(2, 4, 4)
    assert s.schedule([2, 1]).pages == {1: [(0, 4)]}  # stream 1's 10th position fits its 3rd page
    assert blocks.pages == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="prefix of 0 positions"):
        s.admit(3, 4, 0)
    without_pages = Scheduler(1)
    without_pages.admit(1, 10, 3)
    assert without_pages.schedule([1]).pages == {}


def test_an_unknown_stream_cannot_be_scheduled():
    with pytest.raises(KeyError):
        Scheduler(1).schedule([5])


# -- what a request means ------------------------------------------------------------------------------


def test_a_new_stream_on_a_live_id_is_refused_and_the_live_stream_is_left_alone():
    s = Scheduler(2)
    s.admit(5, 10, 1)
    assert s.refusal(5) == "this correlation id is in use"
    assert list(s.streams) == [5] and s.streams[5].slot == 0 and s.active == 1


def test_a_new_stream_needs_an_id_and_a_freed_id_is_admissible_again():
    s = Scheduler(2)
    assert s.refusal(0) == "a generator stream needs a correlation id"
    assert s.refusal(9) == ""
    s.admit(9, 10, 1)
    s.finish(9)
    assert s.refusal(9) == ""
