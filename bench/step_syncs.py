"""Host syncs per generator step, counted by :class:`bench.device_audit.DeviceAudit` (``bench/gpu.sh``).

On CUDA the audit only counts (real values flow), and PyTorch's own sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``, a warning for every synchronising call) counts the same
steps independently. On the meta device (no GPU) the audit stands in zeros for what the host reads: the
count is what a GPU would do, in the dtypes of the model it is given.

The budget is one sync per step: the stop decision reads the stop probabilities on the host. The first
step also prefills every stream; a prefill needs no sync either.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from bench.device_audit import D2H, H2D_ASYNC, H2D_BLOCKING, SYNC, DeviceAudit
from engine.fireredtts3 import FireRedTTS3
from engine.params import GenerationParams
from engine.prompt import VoicePrompt

STEP_BUDGET = 1  # the stop probabilities' .tolist(): whether a stream stops decides its flow call


@dataclass(frozen=True)
class StepSyncs:
    """What one generator step made the host wait for."""

    syncs: int  # device -> host reads plus blocking copies to the device (the audit's count)
    d2h: int  # of which device -> host reads
    h2d_blocking: int  # of which copies to the device without non_blocking=True
    h2d_async: int  # copies to the device with non_blocking=True (no sync)
    cuda_count: int | None  # syncs by PyTorch's sync debug mode (CUDA only), an independent count
    report: str  # one line per (kind, op, line of our code)


@contextlib.contextmanager
def cuda_sync_warnings(device: torch.device):
    """A list that fills with one entry per synchronising CUDA call made inside (None off CUDA)."""
    if device.type != "cuda":
        yield None
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        found: list = []
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(before)
            found += [w for w in caught if "synchronizing" in str(w.message)]


@torch.inference_mode()
def step_syncs(
    model: FireRedTTS3, tokens: list[int], prompt: VoicePrompt, n: int, attention: str = "sdpa", steps: int = 3,
    flow_steps: int = 10,
) -> list[StepSyncs]:  # fmt: skip
    """``n`` streams of ``tokens`` and ``prompt`` through one generator on ``model``'s device (``cuda`` or
    ``meta``): ``steps`` steps, each audited; the first prefills every stream."""
    gen = model.generator(n, 1 + len(tokens) + prompt.num_patches + steps, attention=attention)
    params = GenerationParams(seed=0, steps=flow_steps, min_patches=steps, max_patches=steps)
    streams = [gen.new_stream(i, tokens, prompt, params) for i in range(n)]
    out = []
    for _ in range(steps):
        with cuda_sync_warnings(model.device) as cuda, DeviceAudit(model.device) as audit:
            gen.step(streams)
        out.append(
            StepSyncs(audit.count(SYNC), audit.count(D2H), audit.count(H2D_BLOCKING), audit.count(H2D_ASYNC),
                      None if cuda is None else len(cuda), audit.report())
        )  # fmt: skip
    return out


def describe(counts: list[StepSyncs], n: int, attention: str, where: str) -> str:
    """One line for ``bench/gpu.sh``'s notes: syncs per step against the budget, and where any extra came from."""
    per_step = ", ".join(str(c.syncs) for c in counts)
    line = (
        f"host syncs per generator step ({n} streams, {attention}, {where}; the first step prefills): {per_step} "
        f"(budget {STEP_BUDGET}: the stop decision); non_blocking copies to the device per step: "
        + ", ".join(str(c.h2d_async) for c in counts)
    )
    if all(c.cuda_count is not None for c in counts):
        line += "; CUDA's sync debug mode counted " + ", ".join(str(c.cuda_count) for c in counts)
    over = [c for c in counts if c.syncs > STEP_BUDGET or (c.cuda_count or 0) > STEP_BUDGET]
    if over:
        line += "; OVER BUDGET, from:\n" + "\n".join(f"      {row}" for row in over[-1].report.splitlines())
    return line
