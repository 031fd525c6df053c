"""The Instruct text phase's next-token choice, batched over streams with per-stream settings and RNGs.

FireRedTTS3-Instruct writes text before it speaks (the voice plan of a design, the rewritten transcript
of a semantic edit). The reference picks each text token with Hugging Face's logits processors, in this
order, each left out when its value is neutral:

1. repetition penalty over the tokens generated so far (any sampling mode; 1.0 = off),
2. temperature (1.0 = off), 3. top-k (0 = off), 4. top-p (1.0 = off) — only when sampling,

then ``multinomial(softmax(scores.float()))`` when sampling, ``argmax`` when not.

:func:`next_tokens` does the same with the same tensor operations, so the processed scores are equal bit
for bit and a stream seeded like the reference draws the same ids. Rows are grouped by their settings and
each group is processed as one batch: every operation works row by row (elementwise, or along the
vocabulary), so a row's scores do not depend on the other rows of its group, and each row draws from its
own ``torch.Generator`` — a stream's tokens never depend on who else is in the batch.
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


def next_tokens(
    logits: torch.Tensor,
    generated: list[list[int]],
    sampling: list[TextSampling],
    rngs: list[torch.Generator],
) -> list[int]:
    """The next text token of every row.

    Args:
        logits: (B, V) LM-head scores at each row's last position, any float dtype (the processors run in
            it, as the reference's do; the softmax runs in float32).
        generated: B lists, the tokens each row's text phase has produced so far (the prompt is not
            included: the reference hands the processors only the generated ids). The repetition penalty
            reads them.
        sampling: B settings.
        rngs: B generators on ``logits.device``; a sampling row draws exactly one multinomial sample from
            its own, a greedy row draws nothing.

    Returns:
        B token ids (one host transfer for the whole batch).

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

    chosen = torch.empty(batch, dtype=torch.long, device=logits.device)
    for settings, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        scores = logits.index_select(0, index)
        scores = repetition_penalty(scores, [generated[row] for row in rows], settings.repetition_penalty)
        if not settings.do_sample:
            chosen[index] = scores.argmax(dim=-1)
            continue
        scores = warp(scores, settings)
        probs = torch.softmax(scores.float(), dim=-1)
        for position, row in enumerate(rows):
            chosen[row] = torch.multinomial(probs[position : position + 1], 1, generator=rngs[row])[0, 0]
    return chosen.tolist()


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
    for position, ids in enumerate(generated):
        if ids:
            seen[position, torch.tensor(ids, device=scores.device)] = True
    # Elementwise the same arithmetic as Hugging Face's gather / where / scatter on the seen ids.
    changed = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, changed, scores)
