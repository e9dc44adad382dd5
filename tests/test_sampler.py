"""The sampler against math written here: which tokens top-k and top-p keep (a brute-force loop
in float64), the distribution temperature gives, logprob values, greedy and seeded rows."""

import math

import pytest
import torch

from ostinato.runner import sampler as sampler_module
from ostinato.runner.logits_processors import process_logits
from ostinato.runner.sampler import SampledTokens, Sampler
from ostinato.runner.step import PromptRows, SamplingRow, TokenHistory
from ostinato.sampling_params import SamplingParams


def kept_by_loop(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """Tokens top-k then top-p keep, by hand: rank by logit, keep the first top_k, and of those
    keep a token while the (renormalised) mass ranked above it is below top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    z = sum(math.exp(logits[i]) for i in order)
    kept, above = set(), 0.0
    for i in order:
        if above < top_p:
            kept.add(i)
        above += math.exp(logits[i]) / z
    return kept


def sample(logits: torch.Tensor, params: list[SamplingParams], position: int = 0):
    rows = [SamplingRow(f"r{i}", p, position) for i, p in enumerate(params)]
    return Sampler()(logits, rows)


def test_the_nucleus_keeps_the_tokens_ranked_above_the_top_p_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # ranked: 1 (0.5), 3 (0.3), 2 (0.15), 0
    logits = probs.log()
    n = 4000
    torch.manual_seed(0)
    out = sample(logits.repeat(n, 1), [SamplingParams(top_p=0.7)] * n).token_ids
    counts = torch.bincount(torch.tensor([t[0] for t in out]), minlength=4)
    assert counts[0] == counts[2] == 0  # 0.5 + 0.3 already cover 0.7
    assert abs(counts[1] / n - 0.5 / 0.8) < 0.03  # kept tokens renormalised
    torch.manual_seed(0)
    out = sample(logits.repeat(n, 1), [SamplingParams(top_p=0.9)] * n).token_ids
    counts = torch.bincount(torch.tensor([t[0] for t in out]), minlength=4)
    assert counts[0] == 0 and counts[2] > 0  # 0.8 < 0.9: token 2 joins, token 0 does not


def test_top_k_and_top_p_masks_match_a_brute_force_loop():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 12, generator=gen, dtype=torch.float64).float() * 2
    settings = [(k, p) for k in (-1, 1, 3, 7) for p in (1.0, 0.95, 0.6, 0.2, 0.05, 0.4)]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    rows = [SamplingRow(f"r{i}", p, 0) for i, p in enumerate(params)]
    from ostinato.runner.sampler import _top_k_top_p

    masked = _top_k_top_p(logits, rows)
    for i, (k, p) in enumerate(settings):
        expected = kept_by_loop(logits[i].double().tolist(), k, p)
        kept = set(torch.isfinite(masked[i]).nonzero()[:, 0].tolist())
        assert kept == expected, (k, p)
        assert torch.equal(masked[i, sorted(kept)], logits[i, sorted(kept)])  # values untouched


def assert_masks_without_sorting_as_the_loop(logits, settings, monkeypatch):
    """_top_k_top_p over rows of (top_k, top_p) settings keeps what kept_by_loop keeps, values
    untouched, and never sorts a whole row."""
    from ostinato.runner.sampler import _top_k_top_p

    rows = [
        SamplingRow(f"r{i}", SamplingParams(top_k=k, top_p=p), 0)
        for i, (k, p) in enumerate(settings)
    ]

    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the whole vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    masked = _top_k_top_p(logits, rows)
    for i, (k, p) in enumerate(settings):
        kept = set(torch.isfinite(masked[i]).nonzero()[:, 0].tolist())
        assert kept == kept_by_loop(logits[i].double().tolist(), k, p), (k, p)
        assert torch.equal(masked[i, sorted(kept)], logits[i, sorted(kept)])


def test_a_batch_whose_filters_all_have_a_top_k_ranks_only_those_candidates(monkeypatch):
    """Every filtering row has a top_k: only the candidates are ranked; rows that filter
    nothing keep every logit."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(21, 40, generator=gen, dtype=torch.float64).float() * 2
    settings = [(k, p) for k in (1, 3, 9, 30) for p in (1.0, 0.9, 0.5, 0.05)] + [(-1, 1.0)] * 5
    assert_masks_without_sorting_as_the_loop(logits, settings, monkeypatch)


def test_the_nucleus_kernel_keeps_what_the_brute_force_loop_keeps(monkeypatch):
    """A batch with a top-p-only row masks by the nucleus kernel (under the interpreter here),
    after each row's top-k, over several of the kernel's blocks."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(18, 150, generator=gen, dtype=torch.float64).float() * 3
    settings = [(k, p) for k in (-1, 2, 40) for p in (1.0, 0.97, 0.6, 0.2, 0.05, 0.4)]
    assert_masks_without_sorting_as_the_loop(logits, settings, monkeypatch)


def test_the_nucleus_kernel_equals_its_torch_twin_around_masked_tokens(monkeypatch):
    """Tokens already masked (-inf: min-p, a bitmask) carry no mass, also where a whole block
    of them starts the row."""
    from ostinato.kernels.nucleus import top_p_mask, top_p_mask_torch

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 301, generator=gen) * 2
    logits[1, :130] = float("-inf")
    logits[4, 37:250] = float("-inf")
    top_p = torch.tensor([0.9, 0.99, 0.5, 1.0, 0.8, 0.01])
    want = top_p_mask_torch(logits, top_p)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert torch.equal(top_p_mask(logits, top_p), want)


def test_the_nucleus_search_narrows_every_bit_pattern_of_0_to_1_down_to_one():
    """Each pass keeps ceil(1 / (SPLITS + 1)) of the interval: PASSES must reach one pattern
    (a threshold a few patterns off keeps the same tokens in most rows, so the masks above
    would not notice)."""
    from ostinato.kernels import nucleus

    length, passes = nucleus.ONE_BITS + 1, 0  # from -1 (below 0.0) to 1.0's bits
    while length > 1:
        length, passes = -(-length // (nucleus.SPLITS + 1)), passes + 1
    assert passes <= nucleus.PASSES


def test_sampled_frequencies_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 20_000
    for temperature in (0.5, 2.0):
        torch.manual_seed(1)
        out = sample(logits.repeat(n, 1), [SamplingParams(temperature=temperature)] * n)
        counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=4)
        expected = [math.exp(x / temperature) for x in logits.tolist()]
        for c, e in zip(counts.tolist(), expected, strict=True):
            assert abs(c / n - e / sum(expected)) < 0.015, (temperature, counts)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 30, generator=gen)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams() for i in range(40)]
    torch.manual_seed(0)
    out = sample(logits, params).token_ids
    best = logits.argmax(dim=-1).tolist()
    assert all(out[i] == [best[i]] for i in range(1, 40, 2))
    assert any(out[i] != [best[i]] for i in range(0, 40, 2))  # temperature 1 samples


def test_a_temperature_scales_only_its_own_row():
    """Row 0 at temperature 100 is near uniform; row 1 at 0.01 is near greedy in the same batch."""
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]]).repeat(2000, 1)
    params = [SamplingParams(temperature=100.0), SamplingParams(temperature=0.01)] * 1000
    torch.manual_seed(3)
    out = [t[0] for t in sample(logits, params).token_ids]
    assert all(t == 0 for t in out[1::2])
    assert sum(t != 0 for t in out[0::2]) > 600  # about 3/4 of 1000


def test_logprob_values_are_the_log_softmax_of_the_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 20, generator=gen, dtype=torch.float64)
    reference = logits - logits.exp().sum(dim=-1, keepdim=True).log()  # float64, by hand
    params = [SamplingParams(logprobs=3, seed=9), SamplingParams(), SamplingParams(logprobs=0)]
    out = sample(logits.float(), params)
    assert out.logprobs[1] is None
    for i, n in ((0, 3), (2, 0)):
        token = out.token_ids[i][0]
        (entry,) = out.logprobs[i]
        top = reference[i].argsort(descending=True)[:n].tolist()
        assert set(entry) == set(top) | {token}
        for t, value in entry.items():
            assert value == pytest.approx(float(reference[i, t]), abs=1e-5)


def test_logprobs_asked_by_one_request_only_cover_its_own_rows():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)]
    params.append(SamplingParams(temperature=0.0, logprobs=4))
    out = sample(logits, params)
    assert out.logprobs[0] is None
    assert len(out.logprobs[1][0]) == 1 and len(out.logprobs[2][0]) == 4
    expected = logits.log_softmax(dim=-1)
    for i in (1, 2):
        (entry,) = out.logprobs[i]
        assert max(entry, key=entry.get) == int(logits[i].argmax())
        assert entry[int(logits[i].argmax())] == pytest.approx(float(expected[i].max()), abs=1e-6)


def test_a_seeded_row_depends_on_its_seed_and_position_only():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 50, generator=gen)
    seeded = SamplingParams(seed=11)
    alone = sample(logits, [seeded], position=5).token_ids[0]
    torch.manual_seed(123)  # the unseeded rows' noise changes; the seeded row's must not
    crowd = sample(logits.repeat(6, 1), [SamplingParams()] * 5 + [seeded], position=5).token_ids
    assert crowd[5] == alone
    by_position = {tuple(sample(logits, [seeded], position=p).token_ids[0]) for p in range(30)}
    by_seed = {
        tuple(sample(logits, [SamplingParams(seed=s)], position=5).token_ids[0]) for s in range(30)
    }
    assert len(by_position) > 5 and len(by_seed) > 5


def test_launch_returns_device_tokens_before_the_host_result():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0]])
    rows = [SamplingRow("a", SamplingParams(temperature=0.0), 0)] * 2
    pending = Sampler().launch(logits, rows)
    assert isinstance(pending, SampledTokens)
    assert pending.tokens.tolist() == [1, 0]
    assert pending.result().token_ids == [[1], [0]]


def test_greedy_only_rows_take_the_argmax_of_the_logits_as_they_are(monkeypatch):
    """Rows that want their greedy token and nothing else (a draft's rows included): the argmax
    of the bfloat16 logits, neither widened nor processed; ties go to the first, as in float32.
    A row that asks for more (logprobs, a bias, a penalty) sends the batch the full way."""
    widened = []

    def spy(logits, *args):
        widened.append(logits.dtype)
        return process_logits(logits, *args)

    monkeypatch.setattr(sampler_module, "process_logits", spy)
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 0.0], [0.0, 0.1, 0.2, 0.3]],
                          dtype=torch.bfloat16)  # fmt: skip
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow("a", greedy, 0, (1,)), SamplingRow("b", greedy, 0)]  # a's draft stands
    assert Sampler()(logits, rows).token_ids == [[1, 0], [3]] and not widened
    assert logits.float().argmax(dim=-1).tolist() == [1, 0, 3]
    history = TokenHistory((2,), (1,), False)
    asks = ({"logprobs": 1}, {"logit_bias": {2: 0.5}}, {"presence_penalty": 0.5})
    for params in (SamplingParams(temperature=0.0, **ask) for ask in asks):
        more = SamplingRow("c", params, 1, history=history if params.penalized else None)
        Sampler()(logits[:2], [SamplingRow("b", greedy, 0), more])
        assert widened.pop() == torch.float32


def test_the_warm_up_rows_take_every_path_of_the_sampler(monkeypatch):
    """The engine's warm-up runs the sampler on these rows so that no path first runs (and
    allocates, or compiles) mid-serving: warm_up_rows, a seeded row then greedy and
    everything-else rows in turn, take the logits processors, min-p, top-k with top-p over
    the ranked candidates, the seeded noise and logprobs; nucleus_rows take the top-p mask
    over the whole vocabulary; greedy_rows the argmax of the logits as they are, alone."""
    taken = []

    def spy(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a: taken.append(name) or real(*a))

    for name in ("_min_p", "_top_k_top_p", "top_p_mask", "_position_noise", "argmax_rows"):
        spy(sampler_module, name)
    processed = []  # (logits in, logits out)

    def process(*args):
        processed.append((args[0], process_logits(*args)))
        return processed[-1][1]

    monkeypatch.setattr(sampler_module, "process_logits", process)
    logits = torch.randn(5, 32).bfloat16()
    rows = sampler_module.warm_up_rows(5)
    assert [row.request_id for row in rows] == ["seeded", "greedy", "every", "greedy", "every"]
    out = Sampler()(logits, rows)
    wants_logprobs = [p is not None for p in out.logprobs]
    assert len(out.token_ids) == 5 and wants_logprobs == [False, False, True, False, True]
    assert {"_min_p", "_top_k_top_p", "_position_noise"} <= set(taken)
    assert "top_p_mask" not in taken  # top-k's ranked candidates
    ((before, after),) = processed
    for row in (2, 4):  # min_tokens bans id 0, the bias moves id 5, repetition the prompt's 1
        assert after[row, 0] == float("-inf") and after[row, 5] != before[row, 5]
        assert after[row, 1] != before[row, 1]
    taken.clear()
    assert len(Sampler()(logits[:3], sampler_module.nucleus_rows(3)).token_ids) == 3
    assert "top_p_mask" in taken and "_min_p" not in taken
    taken.clear()
    assert len(Sampler()(logits[:3], sampler_module.greedy_rows(3)).token_ids) == 3
    assert taken == ["argmax_rows"]  # the logits as they are: nothing before it


def test_prompt_scores_of_logits_in_chunks_equal_those_of_one_chunk():
    """PromptScores.score takes the scored rows' logits a few rows at a time: each chunk's
    prompt tokens are the targets that follow the chunks before it."""
    rows = [PromptRows("a", 1, (3, 0, 5), 2), PromptRows("b", 1, (7, 2), 1)]
    logits = torch.randn(5, 8)
    whole = sampler_module.PromptScores.score(rows, iter([logits]), logits.device)
    chunks = sampler_module.PromptScores.score(rows, iter(logits.split(2)), logits.device)
    want = logits.log_softmax(dim=-1)[torch.arange(5), torch.tensor([3, 0, 5, 7, 2])]
    torch.testing.assert_close(whole.chosen, want)
    for got, expected in ((chunks.chosen, whole.chosen), (chunks.top_ids, whole.top_ids)):
        torch.testing.assert_close(got, expected)
