"""Token F1 and ROUGE-L against hand-computed cases."""

from __future__ import annotations

import random

import pytest

from duetime.metrics.quality import lcs_length, rouge_l, token_f1


def test_identical_sequences_score_one() -> None:
    assert token_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_f1([], []) == 1.0
    assert rouge_l([], []) == 1.0


def test_one_empty_or_disjoint_scores_zero() -> None:
    assert token_f1([], [1]) == 0.0
    assert rouge_l([1], []) == 0.0
    assert token_f1([1, 2], [3, 4]) == 0.0
    assert rouge_l([1, 2], [3, 4]) == 0.0


def test_f1_counts_a_multiset_and_ignores_order() -> None:
    # candidate 1 1 2 vs reference 1 2 2 3: overlap {1:1, 2:1} = 2, P = 2/3, R = 2/4
    p, r = 2 / 3, 2 / 4
    assert token_f1([1, 1, 2], [1, 2, 2, 3]) == pytest.approx(2 * p * r / (p + r))
    assert token_f1([3, 2, 1], [1, 2, 3]) == 1.0  # order does not matter for F1


def test_rouge_l_uses_the_longest_common_subsequence() -> None:
    # reversed: LCS = 1 of 3, so P = R = F = 1/3 while F1 = 1
    assert rouge_l([3, 2, 1], [1, 2, 3]) == pytest.approx(1 / 3)
    # candidate 1 4 2 3 vs reference 1 2 3 5 6: LCS = 1 2 3 = 3, P = 3/4, R = 3/5
    p, r = 3 / 4, 3 / 5
    assert rouge_l([1, 4, 2, 3], [1, 2, 3, 5, 6]) == pytest.approx(2 * p * r / (p + r))
    assert lcs_length([7, 1, 7, 2, 7, 3], [1, 2, 3, 7]) == 3


def test_lcs_matches_brute_force_on_random_cases() -> None:
    from itertools import combinations

    rng = random.Random(0)
    for _ in range(60):
        a = [rng.randrange(4) for _ in range(rng.randint(0, 7))]
        b = [rng.randrange(4) for _ in range(rng.randint(0, 7))]
        subs = {
            tuple(a[i] for i in c)
            for k in range(len(a) + 1)
            for c in combinations(range(len(a)), k)
        }

        def is_sub(s: tuple[int, ...], seq: list[int]) -> bool:
            it = iter(seq)
            return all(x in it for x in s)

        best = max(len(s) for s in subs if is_sub(s, b))
        assert lcs_length(a, b) == best
        assert lcs_length(b, a) == best
