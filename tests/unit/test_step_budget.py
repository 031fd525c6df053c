"""The generator's step budget (engine.step_cost.StepBudget): a batch no larger than the hardware carries in
real time, found from the steps it measures; and the same rule over a simulated burst on a GPU-like step."""

from __future__ import annotations

import pytest

from engine.step_cost import BATCH_FLOOR, StepBudget, StepCost


def test_no_budget_admits_any_number_and_a_first_batch_is_the_floor():
    assert StepBudget().room(0) == BATCH_FLOOR and StepBudget().room(3) == BATCH_FLOOR - 3
    off = StepBudget(0)
    off.stepped(5.0, 100)
    assert off.room(100) is None


def test_room_is_what_the_last_step_per_row_leaves_of_the_budget():
    b = StepBudget(0.128)
    b.stepped(0.080, 100)  # 0.8 ms a row (the fixed part spread over the rows: an overestimate)
    assert b.room(100) == 60  # (128 - 80) / 0.8
    assert b.room(50) == 110  # 50 streams ended: (128 - 40) / 0.8
    b.stepped(0.200, 200)  # too slow: nobody joins until streams end
    assert b.room(200) == 0


def test_a_small_batch_is_always_allowed():
    """Where even one stream cannot keep real time (the real model on a CPU), batching up to the floor
    still gives more audio a second than one stream at a time."""
    b = StepBudget(0.128)
    b.stepped(0.500, 1)
    assert b.room(1) == BATCH_FLOOR - 1 and b.room(BATCH_FLOOR) == 0


@pytest.mark.parametrize("cost", [StepCost(80.0, 0.0), StepCost(12.0, 0.25), StepCost(35.0, 1.8)])
def test_a_burst_settles_at_the_largest_batch_within_the_budget(cost):
    """1,024 streams wait; each step admits what the budget leaves room for, then steps everyone. No step
    passes the budget, and within 20 steps the batch reaches at least nine tenths of what the budget allows
    (the estimate errs on the side of fewer streams)."""
    budget = StepBudget(0.128)
    live, waiting, steps = 0, 1024, []
    for _ in range(20):
        room = budget.room(live)
        admit = waiting if room is None else min(waiting, room)
        live, waiting = live + admit, waiting - admit
        seconds = cost.seconds(live)
        budget.stepped(seconds, live)
        steps.append((live, seconds))
    largest = min(1024, int((128 - cost.fixed_ms) / cost.row_ms) if cost.row_ms else 1024)
    assert all(seconds <= 0.128 + 1e-9 for _, seconds in steps)
    assert steps[-1][0] >= 0.9 * largest
    assert steps[-1][0] <= largest
