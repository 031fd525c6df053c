"""Host syncs per generator step, counted by :class:`bench.device_audit.DeviceAudit` (``bench/gpu.sh``).

On CUDA the audit only counts (real values flow), and PyTorch's own sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``, a warning for every synchronising call) counts the same
steps independently. On the meta device (no GPU) the audit stands in zeros for what the host reads: the
count is what a GPU would do, in the dtypes of the model it is given.

The budget is one sync per step: the stop decision reads the stop probabilities on the host. The first
step also prefills every stream; a prefill needs no sync either. A step with FireRedTTS3-Instruct streams
in their text phase (:func:`instruct_step_syncs`) reads one more thing: the picked token ids, 8 bytes a
text row (the scores and the draws stay on the device), so the bytes the host receives per step are
bounded too: :data:`TEXT_ROW_BYTES` per text row plus :data:`STOP_ROW_BYTES` per audio row.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.device_audit import D2H, H2D_ASYNC, H2D_BLOCKING, SYNC, DeviceAudit
from engine.block_manager import BlockManager
from engine.chatml import LATENT_IN_ID, LATENT_OUT_ID, MAX_TEXT_TOKENS
from engine.fireredtts3 import FireRedTTS3
from engine.generator import InstructInput
from engine.params import GenerationParams
from engine.prompt import VoicePrompt
from engine.scheduler import Scheduler
from engine.text_sampling import DESIGN_SAMPLING, EDIT_SAMPLING

STEP_BUDGET = 1  # the stop probabilities' .tolist(): whether a stream stops decides its flow call
TEXT_BUDGET = 1  # ... and, with text rows, the picked ids' .tolist(): the next input embeds them
TEXT_ROW_BYTES = 8  # a text row's token id (int64); its 151,936 scores never leave the device
STOP_ROW_BYTES = 4  # an audio row's stop probability (float32)


@dataclass(frozen=True)
class StepSyncs:
    """What one generator step made the host wait for."""

    syncs: int  # device -> host reads plus blocking copies to the device (the audit's count)
    d2h: int  # of which device -> host reads
    h2d_blocking: int  # of which copies to the device without non_blocking=True
    h2d_async: int  # copies to the device with non_blocking=True (no sync)
    d2h_bytes: int  # bytes the host received from the device
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
    return _audited(model, planned(gen, streams), streams, steps)


@torch.inference_mode()
def instruct_step_syncs(
    model: FireRedTTS3, tokens: list[int], text_rows: int, audio_rows: int, attention: str = "sdpa", steps: int = 3,
    flow_steps: int = 10,
) -> list[StepSyncs]:  # fmt: skip
    """``text_rows`` Instruct streams of ``tokens`` in their text phase (voice design's sampling; every
    third greedy, as a semantic edit picks) beside ``audio_rows`` cloning from a 2-patch prompt (audio phase
    from the start), through one generator on ``model``'s device: ``steps`` steps, each audited; the first
    prefills every stream. ``model`` needs its Instruct core; random weights stay in the text phase (they
    almost never pick ``<|eot|>``), and on meta the ids read as 0."""
    tokens = [t for t in tokens if t not in (LATENT_IN_ID, LATENT_OUT_ID)]  # placeholders need latents
    gen = model.generator(text_rows + audio_rows, len(tokens) + 2 + MAX_TEXT_TOKENS + 1 + steps, attention=attention)
    params = GenerationParams(seed=0, steps=flow_steps, min_patches=steps, max_patches=steps)
    text = [InstructInput(tokens, sampling=EDIT_SAMPLING if i % 3 == 2 else DESIGN_SAMPLING) for i in range(text_rows)]
    prompt = torch.zeros(2 * 4, model.models.instruct.cfg.redae_dim)
    audio = [InstructInput(tokens + [LATENT_OUT_ID] * 2, latents_out=prompt)] * audio_rows
    streams = [gen.new_instruct_stream(i, given, params) for i, given in enumerate(text + audio)]
    return _audited(model, planned(gen, streams), streams, steps)


def planned(gen, streams: list) -> Callable[[list], list]:
    """A bare generator's streams, built in slots 0..n-1, under a :class:`Scheduler` that owns the cache's
    pages, as the server's :class:`~engine.streams.GeneratorService` runs them -> a step function over
    some of the streams (each step's plan hands its pages to ``gen.step``)."""
    c = gen.cache
    scheduler = Scheduler(c.slots, BlockManager(c.slots, c.max_len, c.num_pages, c.page_size))
    ids = {}
    for s in streams:
        state = scheduler.admit(len(ids) + 1, s.positions_needed(), s.prefix_length())
        if state.waiting or state.slot != s.slot:
            raise RuntimeError("the streams must be in slots 0..n-1 of a pool that holds them all")
        ids[id(s)] = state.stream_id

    def step(some: list) -> list:
        return gen.step(some, scheduler.schedule([ids[id(s)] for s in some]).pages)

    return step


def _audited(model: FireRedTTS3, step: Callable[[list], list], streams: list, steps: int) -> list[StepSyncs]:
    out = []
    for _ in range(steps):
        with cuda_sync_warnings(model.device) as cuda, DeviceAudit(model.device) as audit:
            step(streams)
        out.append(
            StepSyncs(audit.count(SYNC), audit.count(D2H), audit.count(H2D_BLOCKING), audit.count(H2D_ASYNC),
                      audit.d2h_bytes(), None if cuda is None else len(cuda), audit.report())
        )  # fmt: skip
    return out


def describe(counts: list[StepSyncs], n: int, attention: str, where: str, text_rows: int = 0) -> str:
    """One line for ``bench/gpu.sh``'s notes: syncs and bytes to the host per step against their budgets,
    and where any extra came from. ``text_rows`` of the ``n`` streams are Instruct's, in their text phase."""
    budget = STEP_BUDGET + (TEXT_BUDGET if text_rows else 0)
    byte_budget = TEXT_ROW_BYTES * text_rows + STOP_ROW_BYTES * (n - text_rows)
    what = f"{n} Instruct streams, {text_rows} in the text phase" if text_rows else f"{n} streams"
    reads = "the text ids and the stop decision" if text_rows else "the stop decision"
    line = (
        f"host syncs per generator step ({what}, {attention}, {where}; the first step prefills): "
        + ", ".join(str(c.syncs) for c in counts) + f" (budget {budget}: {reads}); bytes to the host per step: "
        + ", ".join(str(c.d2h_bytes) for c in counts) + f" (budget {byte_budget}); non_blocking copies to the "
        "device per step: " + ", ".join(str(c.h2d_async) for c in counts)
    )  # fmt: skip
    if all(c.cuda_count is not None for c in counts):
        line += "; CUDA's sync debug mode counted " + ", ".join(str(c.cuda_count) for c in counts)
    over = [c for c in counts if max(c.syncs, c.cuda_count or 0) > budget or c.d2h_bytes > byte_budget]
    if over:
        line += "; OVER BUDGET, from:\n" + "\n".join(f"      {row}" for row in over[-1].report.splitlines())
    return line
