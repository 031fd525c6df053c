"""How long a synthetic generator step lasts (``--synthetic-step``; plain Python, no torch): the cost model
of :mod:`engine.synthetic`, so that a benchmark on a machine without a GPU holds streams alive for as long
as a GPU's steps would. ``fixed + row x rows`` milliseconds: a GPU's batched step reads the weights once
(fixed) and adds each row's flow head and KV-cache read (row). docs/benchmarks.md, "A step-cost model",
derives the presets from the model's sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """How long one synthetic generator step lasts: ``fixed_ms + row_ms x rows`` (rows: the streams it
    steps). The default costs nothing (free math)."""

    fixed_ms: float = 0.0
    row_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.fixed_ms <= 10_000 and 0 <= self.row_ms <= 1_000):
            raise ValueError(f"a step cost needs 0 <= fixed <= 10000 ms and 0 <= row <= 1000 ms, got {self}")

    def seconds(self, rows: int) -> float:
        return (self.fixed_ms + self.row_ms * rows) / 1000.0

    @property
    def free(self) -> bool:
        return self.fixed_ms == 0 and self.row_ms == 0

    def __str__(self) -> str:
        return "free" if self.free else f"{self.fixed_ms:g}+{self.row_ms:g} ms"

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """``""`` or ``"0"`` (free), a preset name (:data:`STEP_PRESETS`), ``"FIXED"`` or ``"FIXED+ROW"`` in
        milliseconds (``"80"``, ``"12+0.25"``); ValueError naming what it takes."""
        text = (text or "").strip().lower()
        if text in STEP_PRESETS:
            return STEP_PRESETS[text]
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(?:\+(\d+(?:\.\d+)?))?", text or "0")
        if not m:
            raise ValueError(f"synthetic step must be FIXED or FIXED+ROW milliseconds (e.g. 80 or 12+0.25) or one "
                             f"of {', '.join(STEP_PRESETS)}, got {text!r}")  # fmt: skip
        return cls(float(m[1]), float(m[2] or 0))


# Estimates of one batched step of the released model (docs/benchmarks.md, "A step-cost model", shows the
# arithmetic): the fixed part reads the weights once and launches the kernels, each row adds its DiT flow
# (10 Euler steps x 2 CFG rows over 12 tokens, ~70 GFLOP) and its KV-cache read.
STEP_PRESETS = {
    "h100": StepCost(12.0, 0.25),
    "l4": StepCost(35.0, 1.8),
}


PATCH_SECONDS = 0.16  # audio one step adds to each stream (engine.chunking.PATCH_SECONDS)
# streams the generator always batches, whatever a step costs (throughput where real time is out of reach)
BATCH_FLOOR = 8


class StepBudget:
    """How many more streams the generator may admit before its next step, so that a step stays within
    ``budget_seconds`` (default 0.8 x 160 ms: every live stream then keeps up with its listener, with room
    for jitter). A step that grows with its batch (a GPU's: the weights once, then each row) makes too large a
    batch too slow for everyone in it; this keeps the batch at the size the hardware carries in real time, and
    the rest wait for a slot in arrival order (first-audio latency, never a stall).

    An idle generator starts a burst with a batch of :data:`BATCH_FLOOR`; the cost of one more row is
    estimated as the last step's time over its rows: at least the true marginal
    cost (the fixed part is spread over the rows), so the estimate errs on the side of fewer streams, and a
    step measured too slow admits nobody until streams end. Up to :data:`BATCH_FLOOR` streams are always
    admitted: where even a small batch cannot keep real time (the real model on a CPU) batching still
    gives more audio per second than one stream at a time. ``budget_seconds`` 0: no budget."""

    def __init__(self, budget_seconds: float = 0.8 * PATCH_SECONDS, floor: int = BATCH_FLOOR):
        if not 0 <= budget_seconds <= 10:
            raise ValueError(f"a step budget must be 0 (none) to 10 seconds, got {budget_seconds}")
        self.budget, self.floor = budget_seconds, floor
        self.seconds = 0.0  # the last step's wall time
        self.rows = 0  # its rows

    def stepped(self, seconds: float, rows: int) -> None:
        """A step of ``rows`` streams took ``seconds``."""
        self.seconds, self.rows = seconds, rows

    def room(self, live: int) -> int | None:
        """Streams that may join the ``live`` ones now (None: any number). Before any step is measured, a
        first batch of the floor; from there the batch grows as fast as the measured steps show room."""
        if not self.budget:
            return None
        if not self.rows:
            return max(self.floor - live, 0)
        per_row = self.seconds / self.rows
        if per_row <= 0:
            return None
        predicted = per_row * live
        fits = int((self.budget - predicted) / per_row + 1e-9) if predicted < self.budget else 0
        return max(fits, self.floor - live, 0)
