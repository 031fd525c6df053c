"""Synthetic math, for benchmarks only: a generator and a vocoder whose networks are replaced by
ready-made output, so that everything around them (the Triton models, BLS, the sequence batcher, the
scheduler, chunking, tensors, gRPC, the client) runs for real and costs what it costs. No speech.

- :class:`SyntheticFireRedTTS3`: a loaded :class:`~engine.fireredtts3.FireRedTTS3` whose
  :meth:`~SyntheticFireRedTTS3.generator` steps without the backbone, the flow head or the patch
  encoder. Streams are checked, admitted, reserve and release KV-cache pages and are chunked as with
  the real generator; each step gives every stream the same ready-made patch and a stream ends after
  ``max_patches`` (reason "length"; the stop head is not consulted).
- :class:`SyntheticVocoderService`: a :class:`~engine.vocoder_service.VocoderService` whose decoder returns
  ready-made samples, 960 per latent (3840 per patch), and nothing at the end of a stream, so that a
  stream of P patches gives exactly P x 3840 samples (what the real decoder gives in total). Its
  stream table (start, unknown stream, end, idle reaping) is the real one.

The prompt encoder stays real. Served with ``--synthetic-math`` (``python -m bench.ceiling`` does).

Free synthetic math makes a step cost almost nothing, so a stream is generated in a fraction of a second
and few are ever alive at once: a benchmark then measures a burst, not live streams. :class:`StepCost`
(``--synthetic-step``) gives the synthetic step the duration of a real one, ``fixed + row x rows``
milliseconds, as a GPU's batched step grows with its batch; the step sleeps out what its bookkeeping did
not use (``time.sleep`` lets go of the GIL, so the rest of the process runs meanwhile, as it does while a
GPU computes). How the presets' numbers come from the model's sizes: docs/benchmarks.md, "A step-cost
model".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import PATCH_SAMPLES, SAMPLES_PER_LATENT
from engine.fireredtts3 import FireRedTTS3
from engine.generator import Generator, StepResult, Stream
from engine.protocol import LENGTH, SAMPLE_RATE
from engine.step_cost import StepCost
from engine.vocoder_service import VocoderService

BANNER = "SYNTHETIC MATH: ready-made latents and audio instead of the model (benchmarks only, no speech)"
TONE_HZ, TONE_LEVEL = 220.0, 0.05  # the ready-made audio: a quiet tone, plainly not speech


def ready_patch(patch_size: int = 4, dim: int = 64) -> torch.Tensor:
    """The latents every synthetic step returns: (patch_size, dim) float32, small and fixed."""
    return 0.1 * torch.randn(patch_size, dim, generator=torch.Generator().manual_seed(0))


@dataclass
class SyntheticGenerator(Generator):
    """A :class:`~engine.generator.Generator` whose step is bookkeeping only (same interface, same cache).

    :meth:`new_stream` is the real one (validation; the scheduler reserves, takes and releases the pages);
    :meth:`step` writes the plan's pages into the page table and advances positions as the real step
    does, and returns :func:`ready_patch`.
    """

    cost: StepCost = field(default_factory=StepCost)  # how long a step lasts (default: free)
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep  # lets go of the GIL while it waits, as a GPU's step does

    def __post_init__(self) -> None:
        cfg = self.core.cfg
        self.patch = ready_patch(cfg.patch_size, cfg.redae_dim)
        self.placeholder = torch.zeros(1, 1, 1)  # a prefilled stream's next input (never read here)

    @torch.inference_mode()
    def step(self, streams: list[Stream], pages: dict[int, list[tuple[int, int]]] | None = None) -> list[StepResult]:
        """Advance each stream by one patch: (4, 64) ready-made latents; finished after max_patches. The
        step lasts :attr:`cost` for its rows (its bookkeeping included)."""
        t0 = self.clock()
        if len({s.slot for s in streams}) != len(streams):
            raise ValueError("two streams share a slot")
        if pages:
            self.cache.assign(pages)
        results = []
        for s in streams:
            # the positions the real step writes: the prefix on a stream's first step, then one per step
            s.position = s.prefix_length() if not s.prefilled else s.position + 1
            s.next_input = self.placeholder
            s.patches += 1
            s.finished = s.patches >= s.params.max_patches
            results.append(StepResult(self.patch, s.finished, LENGTH if s.finished else ""))
        if not self.cost.free and (left := self.cost.seconds(len(streams)) - (self.clock() - t0)) > 0:
            self.sleep(left)
        return results


class SyntheticFireRedTTS3(FireRedTTS3):
    """The loaded ``model``'s networks (tokenizer, configs, prompt encoder), with a synthetic generator."""

    def __init__(self, model: FireRedTTS3, cost: StepCost | None = None):
        super().__init__(model.models, model.device, model.dtype, model.dtypes)
        self.cost = cost or StepCost()

    def generator(self, *args, **kwargs) -> SyntheticGenerator:
        """The real :meth:`FireRedTTS3.generator`'s cache (pages and page table) under a synthetic step."""
        real = super().generator(*args, **kwargs)
        return SyntheticGenerator(real.core, real.cache, cost=self.cost)


class SyntheticDecoder:
    """A primed decoder's interface (:class:`~engine.fireredtts3.PrimedDecoder`) with nothing to decode."""

    to_skip = 0

    def clone(self) -> SyntheticDecoder:
        return SyntheticDecoder()

    def finish(self) -> np.ndarray:
        return np.zeros(0, np.float32)


class SyntheticVocoderService(VocoderService):
    """Ready-made samples for every chunk: (len(latents) x 960,) float32, a quiet tone. No priming."""

    def __init__(self, model: FireRedTTS3, idle_seconds: float = 60.0, max_streams: int = 1024):
        super().__init__(model, idle_seconds, primed_cache=0, max_streams=max_streams)
        length = 16 * PATCH_SAMPLES  # a longer chunk gets the tone tiled
        self.tone = (TONE_LEVEL * np.sin(2 * math.pi * TONE_HZ / SAMPLE_RATE * np.arange(length))).astype(np.float32)

    def _primed(self, prompt_latents: np.ndarray) -> SyntheticDecoder:
        return SyntheticDecoder()

    def samples(self, latents: int) -> np.ndarray:
        """(latents x 960,) float32 ready-made samples."""
        n = latents * SAMPLES_PER_LATENT
        if n <= len(self.tone):
            return self.tone[:n].copy()
        return np.resize(self.tone, n)

    def _decode(self, chunks: list, group: list[int], parts: dict, results: list) -> None:
        for i in group:
            parts[i].append(self.samples(len(chunks[i].latents)))
        if len(group) > 1:
            self.batched_rows += len(group)
