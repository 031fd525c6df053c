"""Unit tests for engine.text_sampling: hand-worked processor cases and the batching properties.

Bit-for-bit agreement with Hugging Face's processors is checked outside the suite (transformers is not a
dependency); these tests pin the arithmetic on small cases worked out by hand, that a row's token
depends only on its own logits, history, settings and generator, that the draw on the CPU is
``torch.multinomial``'s (ids and generator state), and that choosing reads nothing back from the device
(on meta, under the device audit). On CUDA (marked ``gpu``): same seed, same ids, whoever shares the batch.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.text_sampling import (
    DESIGN_SAMPLING,
    EDIT_SAMPLING,
    TextSampling,
    choose,
    host_ids,
    next_tokens,
    repetition_penalty,
    text_generator,
    warp,
)

INF = math.inf


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_reference_settings() -> None:
    assert DESIGN_SAMPLING == TextSampling(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    assert DESIGN_SAMPLING.repetition_penalty == 1.0
    assert EDIT_SAMPLING.do_sample is False and EDIT_SAMPLING.repetition_penalty == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0}, {"temperature": -1.0}, {"temperature": math.nan}, {"temperature": "0.7"},
        {"top_k": -1}, {"top_k": 2.0}, {"top_k": True}, {"top_p": 1.5}, {"top_p": -0.1},
        {"repetition_penalty": 0.0}, {"repetition_penalty": math.inf}, {"do_sample": 1},
    ],
)  # fmt: skip
def test_settings_are_validated(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        TextSampling(**kwargs)


def test_repetition_penalty_by_hand() -> None:
    scores = torch.tensor([[2.0, -1.0, 0.5, -3.0, 0.0]])
    # ids 0 and 1 seen (1 twice: penalized once); positive / 2, negative * 2, zero stays zero
    out = repetition_penalty(scores, [[1, 0, 1, 4]], 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, 0.0]]
    assert repetition_penalty(scores, [[1, 0]], 1.0) is scores  # neutral: skipped
    assert repetition_penalty(scores, [[]], 2.0).tolist() == scores.tolist()
    # a penalty below 1 rewards: 2.0 / 0.5 = 4.0
    assert repetition_penalty(scores, [[0]], 0.5)[0, 0].item() == 4.0


def test_repetition_penalty_rows_see_their_own_history() -> None:
    scores = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    out = repetition_penalty(scores, [[0], [], [1]], 4.0)
    assert out.tolist() == [[0.25, 1.0], [1.0, 1.0], [1.0, 0.25]]


def test_temperature_by_hand() -> None:
    scores = torch.tensor([[1.0, -3.0, 0.25]])
    assert warp(scores, TextSampling(temperature=0.5)).tolist() == [[2.0, -6.0, 0.5]]
    assert warp(scores, TextSampling(temperature=2.0)).tolist() == [[0.5, -1.5, 0.125]]
    assert warp(scores, TextSampling()) is scores  # every step neutral: nothing runs


def test_top_k_keeps_k_and_ties_with_the_kth() -> None:
    assert warp(torch.tensor([[1.0, 5.0, 3.0, 4.0]]), TextSampling(top_k=2)).tolist() == [[-INF, 5.0, -INF, 4.0]]
    # the 2nd highest is 3.0 and two tokens have it: both stay (3 tokens kept for k = 2)
    assert warp(torch.tensor([[1.0, 3.0, 3.0, 7.0]]), TextSampling(top_k=2)).tolist() == [[-INF, 3.0, 3.0, 7.0]]
    # k past the vocabulary keeps everything
    assert warp(torch.tensor([[1.0, 2.0]]), TextSampling(top_k=50)).tolist() == [[1.0, 2.0]]


def test_top_p_by_hand() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    scores = torch.tensor([probs]).log()
    # ascending 0.05, 0.15, 0.3, 0.5 -> mass so far 0.05, 0.20, 0.50, 1.0; dropped while <= 1 - top_p
    kept = {p: [i for i, v in enumerate(warp(scores, TextSampling(top_p=p))[0].tolist()) if v > -INF]
            for p in (0.9, 0.75, 0.45, 0.0)}  # fmt: skip
    assert kept == {0.9: [1, 2, 3], 0.75: [1, 3], 0.45: [1], 0.0: [1]}  # the most probable always stays


def test_steps_apply_in_order() -> None:
    # temperature before top-p changes what top-p keeps: at T = 0.25 the top token holds > 90 % of the mass
    scores = torch.tensor([[0.0, 1.0]])
    assert warp(scores, TextSampling(top_p=0.8)).isinf().sum() == 0  # p = 0.27, 0.73: both needed
    assert warp(scores, TextSampling(temperature=0.25, top_p=0.8)).tolist() == [[-INF, 4.0]]


def test_greedy_is_argmax_and_draws_nothing() -> None:
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 2.0, 1.0, 0.0]])
    generators = [rng(1), rng(2)]
    before = [g.get_state() for g in generators]
    # row 0: a tie goes to the first; row 1: the penalty halves 3.0 below 2.0
    sampling = [EDIT_SAMPLING, TextSampling(do_sample=False, repetition_penalty=2.0, temperature=0.01)]
    assert next_tokens(logits, [[], [0]], sampling, generators) == [1, 1]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, before, strict=True))


def test_top_k_one_and_top_p_cut_to_one_token_sample_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=rng(0))
    for settings in (TextSampling(top_k=1), TextSampling(top_p=0.01), TextSampling(temperature=3.0, top_k=1)):
        for seed in range(5):
            out = next_tokens(logits, [[]] * 6, [settings] * 6, [rng(seed + i) for i in range(6)])
            assert out == logits.argmax(dim=-1).tolist()


def test_sampling_draws_one_sample_from_the_row_generator() -> None:
    logits = torch.zeros(1, 10)
    generator = rng(3)
    before = generator.get_state()
    next_tokens(logits, [[]], [TextSampling()], [generator])
    assert not torch.equal(generator.get_state(), before)


def test_sampling_frequencies_follow_the_warped_distribution() -> None:
    # logits log(4, 3, 2, 1) at temperature 0.5 -> weights 16, 9, 4, 1; top_k=3 drops the last -> 16/29, 9/29, 4/29
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).log()
    settings = TextSampling(temperature=0.5, top_k=3)
    generator = rng(11)
    draws = [next_tokens(logits, [[]], [settings], [generator])[0] for _ in range(6000)]
    for token, weight in enumerate((16, 9, 4, 0)):
        assert abs(draws.count(token) / len(draws) - weight / 29) < 0.02


def _run(rows: list[tuple[TextSampling, int, list[torch.Tensor]]], order_seed: int | None) -> list[list[int]]:
    """Each row's text phase over its own per-step logits, batched in random groups (None: each row alone)."""
    generators = [rng(seed) for _, seed, _ in rows]
    produced: list[list[int]] = [[] for _ in rows]
    steps = len(rows[0][2])
    chooser = random.Random(order_seed)
    while any(len(p) < steps for p in produced):
        waiting = [i for i, p in enumerate(produced) if len(p) < steps]
        if order_seed is None:
            batch = waiting[:1]
        else:
            chooser.shuffle(waiting)
            batch = waiting[: chooser.randint(1, len(waiting))]
        logits = torch.cat([rows[i][2][len(produced[i])] for i in batch])
        tokens = next_tokens(
            logits, [list(produced[i]) for i in batch], [rows[i][0] for i in batch], [generators[i] for i in batch]
        )
        for i, token in zip(batch, tokens, strict=True):
            produced[i].append(token)
    return produced


def _rows(count: int, steps: int = 8, vocab: int = 40) -> list[tuple[TextSampling, int, list[torch.Tensor]]]:
    settings = [
        DESIGN_SAMPLING, EDIT_SAMPLING, TextSampling(), TextSampling(temperature=1.3, top_p=0.9),
        TextSampling(top_k=5, repetition_penalty=1.5), TextSampling(do_sample=False, repetition_penalty=1.2),
    ]  # fmt: skip
    source = rng(123)
    rows = []
    for i in range(count):
        logits = [torch.randn(1, vocab, generator=source) * 2 for _ in range(steps)]
        rows.append((settings[i % len(settings)], 2 + i // len(settings), logits))
    return rows


def test_a_row_in_a_mixed_batch_equals_the_row_alone() -> None:
    rows = _rows(12)
    alone = _run(rows, order_seed=None)
    for order_seed in (0, 1, 2):
        assert _run(rows, order_seed) == alone


def test_a_rows_tokens_do_not_depend_on_the_other_rows() -> None:
    rows = _rows(12)
    companions = _rows(12)[6:]  # other settings and seeds, other logits
    companions = [(s, seed + 100, [x.flip(-1) for x in logits]) for s, seed, logits in companions]
    mine = _run(rows[:6], order_seed=5)
    mixed = _run(rows[:6] + companions, order_seed=6)
    assert mixed[:6] == mine


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    rows = _rows(4, steps=12)
    again = _run(rows, order_seed=3)
    assert _run(rows, order_seed=4) == again
    reseeded = [(s, seed + 1000, logits) for s, seed, logits in rows]
    assert _run(reseeded, order_seed=3)[0] != again[0]  # row 0 samples (voice design settings)


def test_low_precision_logits_are_processed_in_their_dtype() -> None:
    logits = torch.randn(3, 30, generator=rng(4)).to(torch.bfloat16)
    assert warp(logits, DESIGN_SAMPLING).dtype == torch.bfloat16
    out = next_tokens(logits, [[]] * 3, [DESIGN_SAMPLING] * 3, [rng(i) for i in range(3)])
    assert all(0 <= t < 30 for t in out)


def test_arguments_must_agree_on_the_batch() -> None:
    with pytest.raises(ValueError, match="one row each"):
        next_tokens(torch.zeros(2, 5), [[]], [EDIT_SAMPLING] * 2, [rng(0)] * 2)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        next_tokens(torch.zeros(5), [[]], [EDIT_SAMPLING], [rng(0)])


# -- on the device ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [DESIGN_SAMPLING, TextSampling(), TextSampling(temperature=1.3, top_p=0.9)])
def test_a_cpu_draw_is_torch_multinomials_draw(settings: TextSampling) -> None:
    # the reference samples with torch.multinomial from the processed scores; ours writes its algorithm
    # out (to skip its host reads on a GPU): the same ids, and the generators end in the same state
    source = rng(7)
    for seed in range(40):
        logits = torch.randn(3, 151_936 if seed % 10 == 0 else 64, generator=source) * 3
        mine, theirs = [rng(seed + i) for i in range(3)], [rng(seed + i) for i in range(3)]
        for _ in range(3):
            got = next_tokens(logits, [[]] * 3, [settings] * 3, mine)
            probs = torch.softmax(warp(logits, settings).float(), dim=-1)
            want = [torch.multinomial(probs[i : i + 1], 1, generator=theirs[i]).item() for i in range(3)]
            assert got == want
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs, strict=True))


def test_the_text_generator_is_the_streams_own_on_the_cpu_and_a_stand_in_on_meta() -> None:
    host = rng(1234)
    assert text_generator(torch.device("cpu"), host) is host  # text draws, then noise: the reference's order
    stand_in = text_generator(torch.device("meta"), host)
    assert stand_in is not host and stand_in.device.type == "cpu" and stand_in.initial_seed() == 1234


def test_choosing_on_the_device_reads_nothing_back() -> None:
    from bench.device_audit import D2H, H2D_BLOCKING, DeviceAudit

    logits = torch.zeros(5, 151_936, device="meta", dtype=torch.float32)
    sampling = [DESIGN_SAMPLING, EDIT_SAMPLING, DESIGN_SAMPLING, TextSampling(top_k=5, repetition_penalty=1.5),
                TextSampling(do_sample=False, repetition_penalty=1.2)]  # fmt: skip
    generators = [text_generator(torch.device("meta"), rng(i)) for i in range(5)]
    with DeviceAudit("meta") as audit:
        ids = choose(logits, [[3, 9], [], [1], [4, 4, 7], [2]], sampling, generators)
    assert ids.device.type == "meta" and ids.shape == (5,) and ids.dtype == torch.long
    assert audit.count(D2H) == 0 and audit.count(H2D_BLOCKING) == 0, audit.report()
    with DeviceAudit("meta") as audit:
        assert host_ids(ids) == [0] * 5  # meta reads as zeros
    assert audit.d2h_bytes() == 5 * 8, audit.report()  # the one read: 8 bytes a row


def test_a_sampling_row_with_nan_scores_is_refused_not_drawn() -> None:
    logits = torch.zeros(2, 10)
    logits[1, 3] = math.nan
    ids = choose(logits, [[], []], [TextSampling(), TextSampling()], [rng(0), rng(1)])
    assert ids[1].item() == -1 and 0 <= ids[0].item() < 10
    with pytest.raises(RuntimeError, match="nan"):
        host_ids(ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_same_seed_gives_the_same_ids_whoever_shares_the_batch() -> None:
    # CUDA's Philox stream is not the CPU's Mersenne Twister: the ids are not the CPU's, but they are
    # deterministic per seed and a row's do not depend on its neighbours; and they follow the distribution
    cuda = torch.device("cuda")
    logits = (torch.randn(6, 151_936, generator=rng(3)) * 3).to(cuda)
    sampling = [DESIGN_SAMPLING, EDIT_SAMPLING, TextSampling(temperature=1.3, top_p=0.9)] * 2

    def run(rows: list[int]) -> list[list[int]]:
        generators = [text_generator(cuda, rng(100 + i)) for i in rows]
        out: list[list[int]] = [[] for _ in rows]
        for _ in range(4):
            ids = host_ids(choose(logits[rows], [o[:] for o in out], [sampling[i] for i in rows], generators))
            for o, token in zip(out, ids, strict=True):
                o.append(token)
        return out

    together = run(list(range(6)))
    assert run(list(range(6))) == together
    assert [run([i])[0] for i in range(6)] == together
    small = torch.tensor([[4.0, 3.0, 2.0, 1.0]], device=cuda).log()
    generator = text_generator(cuda, rng(11))
    settings = TextSampling(temperature=0.5, top_k=3)
    draws = [host_ids(choose(small, [[]], [settings], [generator]))[0] for _ in range(3000)]
    for token, weight in enumerate((16, 9, 4, 0)):
        assert abs(draws.count(token) / len(draws) - weight / 29) < 0.03
