"""The n-gram (prompt lookup) proposer against a plain definition, and its incremental state."""

import random
from collections import Counter

import numpy as np
import pytest

from ostinato.engine.sequence import Sequence
from ostinato.sampling_params import SamplingParams
from ostinato.speculative.ngram import NgramProposer, propose_ngram


def reference(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The definition, by brute force: the longest suffix (ngram_max down to ngram_min) that
    occurred earlier, its latest earlier occurrence, and the k tokens after it, continuing
    periodically past the end of the context."""
    n_tokens = len(tokens)
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = tokens[n_tokens - n :]
        starts = [s for s in range(n_tokens - n) if tokens[s : s + n] == suffix]
        if starts:
            context = list(tokens)
            after = starts[-1] + n
            for i in range(k):
                context.append(context[after + i])
            return context[n_tokens:]
    return []


def propose(tokens, k=4, ngram_min=1, ngram_max=4):
    return propose_ngram(np.asarray(tokens, dtype=np.int64), k, ngram_min, ngram_max)


def test_copies_what_followed_the_earlier_occurrence():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9, 1]


def test_longest_match_beats_a_later_shorter_one():
    # "7 3" ends the context; "3" alone last occurred before 8, but "7 3" before 5.
    assert propose([7, 3, 5, 6, 3, 8, 7, 3], k=2) == [5, 6]


def test_latest_occurrence_of_the_longest_match_wins():
    assert propose([4, 1, 2, 4, 3, 9, 4], k=2) == [3, 9]


def test_ngram_min_refuses_shorter_matches():
    tokens = [5, 1, 2, 9, 1, 2]
    assert propose(tokens, k=3, ngram_min=2) == [9, 1, 2]
    assert propose(tokens, k=3, ngram_min=3) == []


def test_a_loop_is_continued_with_its_period():
    assert propose([8, 7, 7], k=5) == [7, 7, 7, 7, 7]
    assert propose([1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]


@pytest.mark.parametrize("tokens", [[], [3], [1, 2, 3, 4]])
def test_nothing_to_match(tokens):
    assert propose(tokens) == []


def test_agrees_with_the_definition_on_random_contexts():
    rng = random.Random(0)
    for _ in range(3000):
        vocab, length = rng.randint(1, 6), rng.randint(0, 30)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert propose(tokens, k, lo, hi) == reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_proposer_follows_a_growing_request_and_forgets_it():
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    proposer = NgramProposer(k=3, ngram_min=1, ngram_max=3)
    assert proposer.propose(seq) == []
    for token in [1, 2]:  # the output starts to repeat the prompt
        seq.token_ids.append(token)
    assert proposer.propose(seq) == [3, 1, 2]
    seq.token_ids += list(range(10, 100))  # grows past the kept array's capacity
    seq.token_ids += [11, 12]
    assert proposer.propose(seq) == [13, 14, 15]
    proposer.forget("r")
    assert "r" not in proposer._contexts
    assert proposer.propose(seq) == [13, 14, 15]


def test_proposer_agrees_with_a_full_search_however_seldom_it_is_asked():
    """What it keeps per request (earlier tokens as a set, an array updated only for a search)
    gives what a search of the whole context gives, over requests that grow by several tokens
    between the steps it is asked at (the scheduler stops asking once a batch cannot make
    half), from vocabularies where the last token is seldom new to ones where it mostly is."""
    rng = random.Random(1)
    proposer = NgramProposer(k=3, ngram_min=1, ngram_max=3)
    vocabs = {f"r{v}": v for v in (3, 12, 50, 1000)}
    seqs = [Sequence(r, [rng.randrange(v)], SamplingParams()) for r, v in vocabs.items()]
    answers = Counter()
    for _ in range(2000):
        seq = rng.choice(seqs)
        vocab = vocabs[seq.request_id]
        seq.token_ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            draft = proposer.propose(seq)
            assert draft == propose(seq.token_ids, k=3, ngram_max=3), seq.request_id
            answers[bool(draft)] += 1
    assert min(answers.values()) > 100, answers  # drafts and none, both common


def test_drafts_are_python_ints_and_the_state_is_kept_per_request():
    proposer = NgramProposer(3, 1, 4)
    seq = Sequence("r", [1, 2, 3, 1, 2], SamplingParams())
    draft = proposer.propose(seq)
    assert draft == [3, 1, 2] and all(type(t) is int for t in draft)
    kept = proposer._contexts["r"]
    seq.token_ids.append(3)
    assert proposer.propose(seq) == [1, 2, 3]
    assert proposer._contexts["r"] is kept and kept.filled == 6  # extended, not rebuilt
    proposer.forget("r")
    proposer.forget("never seen")  # forgetting an unknown request is not an error
    assert "r" not in proposer._contexts


def test_the_last_token_gate_looks_at_the_last_token_only():
    from ostinato.speculative.ngram import _Context

    assert not _Context().occurred_before_last([5, 6, 9])  # 6 occurred, but is not last
    assert _Context().occurred_before_last([5, 6, 5])
    assert not _Context().occurred_before_last([6, 5, 7, 5][:3])
