"""Sampler: greedy, seeded reproducibility across batches, logprobs, penalties and the truncation filters."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.logit_filters import apply_top_k_top_p
from kvflow.layers.penalties import apply_penalties, suppress_tokens
from kvflow.layers.sampler import Sampler, SamplingRow, make_generator
from kvflow.sampling_params import SamplingParams

VOCAB = 50


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    params: SamplingParams, seed: int | None = None, output: list[int] | None = None, **kw
) -> SamplingRow:
    generator = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(params, kw.pop("prompt", [1, 2, 3]), output or [], generator, **kw)


def test_greedy_rows_take_the_argmax() -> None:
    logits = random_logits(6, seed=0)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(8, seed=1)
    rows = [row(SamplingParams(temperature=1.3, top_k=1), seed=s) for s in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    # The filter itself, used on the sampling path, also leaves only the argmax.
    filtered = apply_top_k_top_p(logits, [1] * 8, [1.0] * 8)
    assert torch.isfinite(filtered).sum(dim=-1).tolist() == [1] * 8
    assert filtered.argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()


def run_steps(make_batch, target: int, steps: int) -> list[int]:
    """Sample `steps` tokens for batch[target], feeding each sampled token back into its output."""
    sampler = Sampler()
    rows = make_batch()
    chosen = []
    for step in range(steps):
        # The target row always sees the same logits; its batchmates get unrelated ones.
        logits = random_logits(len(rows), seed=1000 + step + 17 * len(rows))
        logits[target] = random_logits(1, seed=step)[0]
        out = sampler(logits, rows)
        for r, token in zip(rows, out.token_ids, strict=True):
            r.output_token_ids.append(token)
        chosen.append(out.token_ids[target])
    return chosen


def test_seeded_row_is_reproducible_whatever_the_batch() -> None:
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=7)

    def alone() -> list[SamplingRow]:
        return [row(target, seed=7)]

    def crowded() -> list[SamplingRow]:
        return [
            row(SamplingParams(temperature=0.8, top_k=5, seed=3), seed=3),
            row(SamplingParams(temperature=1.0)),  # unseeded
            row(target, seed=7),
            row(SamplingParams(temperature=0.0, repetition_penalty=1.3)),
            row(SamplingParams(min_p=0.1, frequency_penalty=0.5), suppress_token_ids=[0, 1]),
        ]

    solo = run_steps(alone, target=0, steps=6)
    assert run_steps(crowded, target=2, steps=6) == solo
    assert len(set(solo)) > 1  # genuinely sampling, not stuck on one token


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(3, seed=2)
    rows = [
        row(SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=4), seed=1, output=[5, 6]),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i in (0, 2):
        assert out.logprobs[i] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-5)
    values, ids = reference[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []


def test_penalties_on_a_hand_checked_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    out = apply_penalties(logits, params, prompt_token_ids=[[0], [0]], output_token_ids=[[1, 3, 3], [1]])
    # id 0 (prompt): 2 / 2 = 1. id 1 (output once): -1 * 2 - 0.5 - 0.25. id 3 (output twice): 3 / 2 - 1 - 0.25.
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.5, 0.25, -2.0])
    assert out[1].tolist() == logits[1].tolist()  # no penalties: untouched
    assert logits[0, 0].item() == 2.0  # the input is not modified in place


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = Sampler()(logits, [row(SamplingParams(temperature=0.0), prompt=[0])])
    penalized = Sampler()(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[0])])
    assert plain.token_ids == [0] and penalized.token_ids == [1]


def test_min_tokens_suppression_masks_the_given_ids() -> None:
    logits = random_logits(2, seed=3)
    best = logits.argmax(dim=-1).tolist()
    masked = suppress_tokens(logits, [[best[0]], []])
    assert masked[0, best[0]].item() == float("-inf")
    assert torch.equal(masked[1], logits[1])

    greedy = Sampler()(logits[:1], [row(SamplingParams(temperature=0.0), suppress_token_ids=[best[0]])])
    assert greedy.token_ids == [logits[0].topk(2).indices[1].item()]

    forbidden = logits[0].topk(5).indices.tolist()
    rows = [row(SamplingParams(temperature=2.0), seed=s, suppress_token_ids=forbidden) for s in range(200)]
    picked = Sampler()(logits[0].expand(200, -1), rows).token_ids
    assert not set(picked) & set(forbidden)


PROBS = [0.5, 0.3, 0.15, 0.05]


def sample_many(params: SamplingParams, n: int = 400) -> list[int]:
    logits = torch.tensor(PROBS).log().expand(n, -1)
    return Sampler()(logits, [row(params, seed=s) for s in range(n)]).token_ids


def test_top_p_keeps_only_the_nucleus() -> None:
    # Mass before id 1 is 0.5 < 0.7 (kept); before id 2 it is 0.8 (dropped).
    assert set(sample_many(SamplingParams(top_p=0.7))) == {0, 1}


def test_min_p_drops_unlikely_tokens() -> None:
    # Threshold 0.2 * 0.5 = 0.1: ids 0-2 stay, id 3 (0.05) goes.
    assert set(sample_many(SamplingParams(min_p=0.2))) == {0, 1, 2}


def test_top_k_keeps_the_k_best() -> None:
    assert set(sample_many(SamplingParams(top_k=2))) == {0, 1}


def test_unfiltered_sampling_follows_the_distribution() -> None:
    picked = sample_many(SamplingParams(), n=4000)
    for token, p in enumerate(PROBS):
        assert picked.count(token) / len(picked) == pytest.approx(p, abs=0.03)


def test_low_temperature_approaches_greedy() -> None:
    logits = random_logits(1, seed=4)
    best = logits.argmax().item()
    logits[0, best] += 0.5  # a clear winner, so the limit is visible at a modest temperature

    def greedy_share(temperature: float) -> float:
        picked = Sampler()(
            logits.expand(300, -1), [row(SamplingParams(temperature=temperature), seed=s) for s in range(300)]
        )
        return picked.token_ids.count(best) / 300

    shares = [greedy_share(t) for t in (2.0, 0.5, 0.05)]
    assert shares[0] < shares[1] < shares[2] == 1.0
    # Below the sampler's floor the row is treated as greedy outright.
    assert greedy_share(1e-7) == 1.0


def test_mismatched_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(random_logits(2, seed=5), [row(SamplingParams())])


def test_seeded_generator_advances_only_when_sampling() -> None:
    generator = make_generator(11, "cpu")
    state = generator.get_state().clone()
    Sampler()(random_logits(1, seed=6), [SamplingRow(SamplingParams(temperature=0.0), [], [], generator)])
    assert torch.equal(generator.get_state(), state)
    Sampler()(random_logits(1, seed=6), [SamplingRow(SamplingParams(), [], [], generator)])
    assert not torch.equal(generator.get_state(), state)


def reference_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """The surviving ids of one row, by the plain definition: full sort, top-k, renormalise, nucleus."""
    order = logits.sort(descending=True).indices.tolist()
    survivors = order[:k] if k > 0 else order
    if p >= 1.0:  # off: the float sum of all probabilities may reach 1 before the tail
        return set(survivors)
    probs = logits[survivors].softmax(dim=-1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(survivors, probs, strict=True):
        if mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # 0.05: nearly flat, the nucleus outgrows the window
def test_top_k_top_p_match_the_plain_definition(scale: float) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(9)) * scale
    top_k = [0, 40, 0, 300, 5, 0]
    top_p = [0.9, 0.8, 1.0, 0.95, 0.5, 0.3]
    out = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        survivors = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert survivors == reference_top_k_top_p(logits[i], top_k[i], top_p[i])
        assert torch.equal(out[i][list(survivors)], logits[i][list(survivors)])  # survivors keep their logits


def test_rows_with_filters_off_are_untouched() -> None:
    logits = random_logits(3, seed=10)
    out = apply_top_k_top_p(logits, [0, 3, 0], [1.0, 1.0, 0.5])
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).sum().item() == 3


def test_top_k_beyond_the_vocabulary_cuts_nothing() -> None:
    logits = random_logits(2, seed=11)
    assert torch.equal(apply_top_k_top_p(logits, [VOCAB, 10 * VOCAB], [1.0, 1.0]), logits)
    out = apply_top_k_top_p(logits, [VOCAB + 1, 0], [0.5, 1.0])
    assert 0 < torch.isfinite(out[0]).sum().item() < VOCAB and torch.equal(out[1], logits[1])
