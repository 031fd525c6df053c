"""The Instruct text phase's next-token choice, batched over streams with per-stream settings and RNGs,
on the model's device.

FireRedTTS3-Instruct writes text before it speaks (the voice plan of a design, the rewritten transcript
of a semantic edit). The reference picks each text token with Hugging Face's logits processors, in this
order, each left out when its value is neutral:

1. repetition penalty over the tokens generated so far (any sampling mode; 1.0 = off),
2. temperature (1.0 = off), 3. top-k (0 = off), 4. top-p (1.0 = off) — only when sampling,

then ``multinomial(softmax(scores.float()))`` when sampling, ``argmax`` when not.

:func:`choose` does the same with the same tensor operations, on the scores' device: rows are grouped by
their settings and each group is processed as one batch (every operation works row by row, elementwise
or along the vocabulary, so a row's scores do not depend on the other rows), and each sampling row
draws from its own ``torch.Generator`` on that device. Only the chosen ids leave the device, 8 bytes a
row (:func:`host_ids`), never the 151,936 scores.

The draw is ``multinomial``'s own algorithm for one sample, written out: ``q`` ~ Exp(1) of the row's
shape from the row's generator, then ``argmax(p / q)``. PyTorch's CPU and CUDA ``multinomial`` do
exactly this for one sample, but first check the probabilities with ``.item()`` reads (or, in newer
releases, asynchronous device asserts); a batched call would also take all rows' exponentials from one
generator, so a row's token would depend on its neighbours. One small draw per row, each from its own
generator, stays on the device and needs no host read.

Reproducibility:

- **CPU**: a row's generator is the stream's CPU generator (:func:`text_generator`), the draw consumes it
  exactly as ``torch.multinomial(p, 1, generator=g)`` does, and the processed scores are equal bit for
  bit: a stream seeded like the reference draws the same ids as the reference, and leaves its generator
  in the same state for the flow's noise.
- **CUDA**: a row's generator is a CUDA generator seeded with the stream's seed. Tokens are deterministic
  per seed (same GPU model and PyTorch) and independent of who shares the batch, but they are **not**
  the reference's CPU draws: CUDA's generator is Philox, the CPU's a Mersenne Twister, so the same seed
  gives other exponentials. The comparison with the reference is then statistical (the same processed
  distribution; greedy rows, as semantic edits are, still pick the same argmax up to the device's
  rounding of the scores) or by same-seed determinism.
- **meta** (the CUDA path checked without a GPU): PyTorch has no meta generator; a CPU generator stands
  in, and meta kernels draw nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _number(value) and value > 0


@dataclass(frozen=True)
class TextSampling:
    """How one stream picks its text tokens (Hugging Face's meanings; neutral values switch a step off)."""

    do_sample: bool = True  # False: greedy (argmax after the repetition penalty); the rest is ignored
    temperature: float = 1.0  # scores / temperature; 1.0 = off
    top_k: int = 0  # keep the k highest scores (ties with the k-th kept too); 0 = off
    top_p: float = 1.0  # keep the smallest high-probability set whose mass reaches top_p; 1.0 = off
    repetition_penalty: float = 1.0  # generated tokens: positive scores / p, negative * p; 1.0 = off

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be true or false, got {self.do_sample!r}")
        if not _positive(self.temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _number(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in 0..1 (1 = off), got {self.top_p!r}")
        if not _positive(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )


DESIGN_SAMPLING = TextSampling(True, 0.7, 20, 0.8, 1.0)  # voice design: the reference's values
EDIT_SAMPLING = TextSampling(do_sample=False)  # semantic edit: greedy


def text_generator(device: torch.device, host: torch.Generator) -> torch.Generator:
    """The generator a stream's text tokens are drawn from on ``device``, seeded as ``host`` (the stream's
    CPU generator, which draws the flow's noise) was.

    On the CPU it is ``host`` itself: the reference draws text tokens and then noise from one RNG, and so
    does the stream. On CUDA a generator of its own, ``manual_seed(host.initial_seed())`` (the noise then
    starts where the seed puts it, not after the text draws as on the CPU). On meta, where PyTorch has no
    generator, a CPU generator stands in (meta kernels draw nothing).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "meta":
        return torch.Generator(device="cpu").manual_seed(host.initial_seed())
    return torch.Generator(device=device).manual_seed(host.initial_seed())


def next_tokens(
    logits: torch.Tensor,
    generated: list[list[int]],
    sampling: list[TextSampling],
    rngs: list[torch.Generator],
) -> list[int]:
    """The next text token of every row, on the host: :func:`choose`, then :func:`host_ids`."""
    return host_ids(choose(logits, generated, sampling, rngs))


def choose(
    logits: torch.Tensor,
    generated: list[list[int]],
    sampling: list[TextSampling],
    rngs: list[torch.Generator],
) -> torch.Tensor:
    """The next text token of every row, left on ``logits.device`` (no host read).

    Args:
        logits: (B, V) LM-head scores at each row's last position, any float dtype (the processors run in
            it, as the reference's do; the softmax runs in float32).
        generated: B lists, the tokens each row's text phase has produced so far (the prompt is not
            included: the reference hands the processors only the generated ids). The repetition penalty
            reads them.
        sampling: B settings.
        rngs: B generators on ``logits.device`` (:func:`text_generator`); a sampling row draws one
            Exp(1) vector of V values from its own, a greedy row draws nothing.

    Returns:
        (B,) int64 token ids on ``logits.device``; -1 for a sampling row whose probabilities are not a
        distribution (not finite), which :func:`host_ids` refuses.

    Raises:
        ValueError: The four arguments disagree on B, or logits is not (B, V).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not len(generated) == len(sampling) == len(rngs) == batch:
        raise ValueError(
            f"one row each: logits has {batch}, generated {len(generated)}, sampling {len(sampling)}, rngs {len(rngs)}"
        )
    groups: dict[TextSampling, list[int]] = {}
    for row, settings in enumerate(sampling):
        groups.setdefault(settings, []).append(row)

    if len(groups) == 1:  # the usual step: every text row has one task's settings, in batch order
        (settings,) = groups
        return _group(logits, generated, settings, rngs)
    chosen = torch.empty(batch, dtype=torch.long, device=logits.device)
    for settings, rows in groups.items():
        index = _to(torch.tensor(rows), logits.device)
        chosen[index] = _group(logits.index_select(0, index), [generated[r] for r in rows], settings,
                               [rngs[r] for r in rows])  # fmt: skip
    return chosen


def _group(scores: torch.Tensor, generated: list[list[int]], settings: TextSampling, rngs: list) -> torch.Tensor:
    """(n,) ids of n rows with the same settings, from their (n, V) scores."""
    scores = repetition_penalty(scores, generated, settings.repetition_penalty)
    if not settings.do_sample:
        return scores.argmax(dim=-1)
    return _draw(torch.softmax(warp(scores, settings).float(), dim=-1), rngs)


def host_ids(ids: torch.Tensor) -> list[int]:
    """(B,) ids from :func:`choose` as Python ints: the one device-to-host copy of a step's text rows.

    Raises:
        RuntimeError: a sampling row's probabilities held inf or nan (``multinomial`` would refuse them).
    """
    out = ids.tolist()
    if any(token < 0 for token in out):
        raise RuntimeError("the text phase's probability tensor contains either `inf`, `nan` or element < 0")
    return out


def _draw(probs: torch.Tensor, rngs: list[torch.Generator]) -> torch.Tensor:
    """One id per row of (n, V) float32 probabilities, row i from ``rngs[i]``: ``torch.multinomial(probs[i:
    i + 1], 1, generator=rngs[i])``'s algorithm and randomness, without its host-side checks."""
    picked = []
    for row, rng in enumerate(rngs):
        p = probs[row : row + 1]
        q = torch.empty_like(p).exponential_(1, generator=rng)
        picked.append(p.div(q).argmax(dim=-1))
    valid = (probs.amax(dim=-1) < math.inf) & (probs.amin(dim=-1) >= 0) & (probs.sum(dim=-1) > 0)
    return torch.where(valid, torch.cat(picked), -1)


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (indices) on ``device`` without a sync (a no-op on the CPU)."""
    return host.to(device, non_blocking=True)


def warp(scores: torch.Tensor, settings: TextSampling) -> torch.Tensor:
    """Temperature, top-k and top-p of one group's (n, V) scores (the sampling-only steps); filtered
    entries become -inf, and the highest score always survives."""
    if settings.temperature != 1.0:
        scores = scores / float(settings.temperature)
    if settings.top_k > 0:
        k = min(settings.top_k, scores.shape[-1])
        kth_highest = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth_highest, -math.inf)
    if settings.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= (1 - settings.top_p)
        drop_sorted[..., -1:] = False  # the most probable token is never dropped
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def repetition_penalty(scores: torch.Tensor, generated: list[list[int]], penalty: float) -> torch.Tensor:
    """The repetition penalty on (n, V) scores, row i penalizing the ids in ``generated[i]`` (each once,
    however often it occurs)."""
    if penalty == 1.0 or not any(generated):
        return scores
    seen = torch.zeros_like(scores, dtype=torch.bool)
    where = torch.tensor([[position, token] for position, ids in enumerate(generated) for token in ids]).T
    seen[tuple(_to(where, scores.device))] = True  # one copy of all rows' ids, not one per row
    # Elementwise the same arithmetic as Hugging Face's gather / where / scatter on the seen ids.
    changed = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, changed, scores)
