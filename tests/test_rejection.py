"""Verifying drafts: rejection sampling keeps the target distribution (chi-square tests on a
small vocabulary, seeded, with a p-value bound of 1e-6), greedy verification and logprobs."""

import math

import pytest
import torch

from ostinato.runner.sampler import Sampler
from ostinato.runner.step import SamplingRow
from ostinato.sampling_params import SamplingParams
from ostinato.speculative.rejection import race

V = 5  # vocabulary: 4 degrees of freedom, whose chi-square tail has a closed form
TARGET = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])


def chi2_tail(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic of counts against probs), for an even number of degrees
    of freedom 2m: exp(-x/2) * sum_{i<m} (x/2)^i / i!."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = counts.sum() * probs[keep]
    x = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    assert dof % 2 == 0
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(dof // 2))


def verify(probs: torch.Tensor, draft: int, n: int, seed: int, residual_bug: bool = False):
    g = torch.Generator().manual_seed(seed)
    noise = torch.empty(n, V).exponential_(generator=g)
    drafts = torch.full((n,), draft)
    tokens = race(probs.expand(n, V), noise)
    accepted = tokens == drafts
    if residual_bug:  # an independent coin, then a fresh draw from p itself: the classic mistake
        accepted = (drafts >= 0) & (torch.rand(n, generator=g) < probs[drafts.clamp(min=0)])
        tokens = (probs / torch.empty(n, V).exponential_(generator=g)).argmax(dim=-1)
    first = torch.where(accepted, drafts, tokens)
    return torch.bincount(first, minlength=V), int(accepted.sum())


@pytest.mark.parametrize("draft", [-1, 0, 1, 2, 3, 4])
def test_first_token_is_distributed_as_the_target(draft):
    n = 200_000
    counts, accepted = verify(TARGET, draft, n, seed=draft + 10)
    assert chi2_tail(counts, TARGET) > 1e-6
    if draft >= 0:  # a point-mass draft is accepted with probability p(draft)
        p = float(TARGET[draft])
        assert abs(accepted - n * p) < 6 * math.sqrt(n * p * (1 - p))
    else:
        assert accepted == 0


def test_the_bound_catches_a_sampler_that_ignores_the_residual():
    counts, _ = verify(TARGET, 1, 200_000, seed=3, residual_bug=True)
    assert chi2_tail(counts, TARGET) < 1e-6


def test_drafts_of_probability_zero_are_never_accepted():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    counts, accepted = verify(probs, 1, 50_000, seed=4)
    assert accepted == 0 and counts[1] == 0 and counts[4] == 0


def test_certain_drafts_are_always_accepted():
    _, accepted = verify(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]), 2, 10_000, seed=5)
    assert accepted == 10_000


def processed_target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / temperature) over the top_k logits, written out independently."""
    top = logits.topk(top_k).indices
    weights = torch.zeros_like(logits)
    weights[top] = torch.exp(logits[top] / temperature)
    return weights / weights.sum()


def test_a_chain_of_drafts_keeps_every_conditional_distribution():
    """Rows r0, r1, r2 verify drafts d1, d2 and give the bonus token: the first token must be
    distributed as target(r0); given it is d1, the second as target(r1); given d1 d2, the
    third as target(r2). Temperature and top-k go through the sampler's own processing."""
    torch.manual_seed(0)
    logits = torch.tensor(  # top-k keeps 5 of 6 tokens: 4 degrees of freedom
        [
            [0.3, 2.0, 1.0, 0.5, -1.0, -2.0],
            [1.5, -0.5, 0.2, 1.2, 0.0, 0.1],
            [0.0, 0.4, 0.8, -0.3, 1.1, -3.0],
        ]
    )
    params = SamplingParams(temperature=0.8, top_k=5)
    targets = [processed_target(row, 0.8, 5) for row in logits]
    d1, d2 = 1, 0
    n = 60_000
    rows = [SamplingRow(f"r{i}", params, 0, (d1, d2)) for i in range(n)]
    out = Sampler()(logits.repeat(n, 1), rows).token_ids
    assert all(1 <= len(t) <= 3 for t in out)
    assert all(t[:-1] == [d1, d2][: len(t) - 1] for t in out)  # drafts, then one sample
    first = torch.tensor([t[0] for t in out])
    second = torch.tensor([t[1] for t in out if len(t) > 1])
    third = torch.tensor([t[2] for t in out if len(t) > 2])
    assert len(third) > 10_000
    for sample, target in zip((first, second, third), targets, strict=True):
        assert chi2_tail(torch.bincount(sample, minlength=6), target) > 1e-6


def test_seeded_requests_verify_reproducibly():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(f"r{i}", SamplingParams(seed=i), 7, (2, 3)) for i in range(200)]
    first = Sampler()(logits.repeat(200, 1), rows).token_ids
    assert Sampler()(logits.repeat(200, 1), rows).token_ids == first
    assert len({tuple(t) for t in first}) > 3


def test_verified_drafts_give_the_tokens_decoding_without_them_samples():
    """A seeded request samples the same tokens whether positions 7-9 are drafted (and which
    drafts) or decoded one per step, given the same logits at each position."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    for seed in range(50):
        params = SamplingParams(temperature=1.0, seed=seed)
        plain = [Sampler()(logits[i : i + 1], [SamplingRow("r", params, 7 + i)]).token_ids[0][0]
                 for i in range(3)]  # fmt: skip
        for drafts in (
            (plain[0], plain[1]),
            (plain[0], (plain[1] + 1) % V),
            ((plain[0] + 1) % V, 0),
        ):
            out = Sampler()(logits, [SamplingRow("r", params, 7, drafts)]).token_ids[0]
            assert out == plain[: len(out)], (seed, drafts)


def test_greedy_verification_keeps_the_drafts_up_to_the_first_miss():
    logits = torch.full((7, V), -1.0)
    best = [3, 1, 4, 2, 0, 0, 4]  # argmax of each row
    logits[torch.arange(7), best] = 2.0
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SamplingRow("miss-second", greedy, 0, (3, 2)),  # rows 0-2: 3 stands, 2 != 1
        SamplingRow("all", greedy, 0, (2, 0)),  # rows 3-5: both stand, bonus from row 5
        SamplingRow("plain", greedy, 0),  # row 6
    ]
    assert Sampler()(logits, rows).token_ids == [[3, 1], [2, 0, 0], [4]]


def test_logprobs_come_from_the_row_that_produced_each_token():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(dim=-1).tolist()
    rows = [SamplingRow("a", SamplingParams(temperature=0.0, logprobs=2), 0, (best[0], best[1]))]
    rows.append(SamplingRow("b", SamplingParams(temperature=0.0), 0))
    out = Sampler()(logits, rows)
    assert out.token_ids == [[best[0], best[1], best[2]], [best[3]]]
    assert out.logprobs[1] is None
    expected = logits.log_softmax(dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids[0], out.logprobs[0], strict=True)):
        assert set(expected[i].topk(2).indices.tolist()) | {token} == set(entry)
        assert entry[token] == pytest.approx(float(expected[i, token]), abs=1e-6)
