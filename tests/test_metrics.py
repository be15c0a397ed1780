"""pass@k against brute-force enumeration, its stability at n = 256, and coverage."""

import itertools
from fractions import Fraction
from math import comb

import pytest

from gapo.metrics import coverage, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_over_all_subsets(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("c, k", [(1, 1), (1, 256), (3, 16), (40, 64), (128, 200), (255, 2), (0, 8)])
def test_pass_at_k_stable_for_n_256(c, k):
    exact = 1 - Fraction(comb(256 - c, k), comb(256, k))
    assert pass_at_k(256, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_1_is_the_solve_rate():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)


@pytest.mark.parametrize("args", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1), (-1, 0, 1)])
def test_pass_at_k_rejects_impossible_counts(args):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(*args)


def test_coverage_counts_problems_above_threshold():
    assert coverage([0.0, 0.05, 0.051, 0.5, 1.0]) == 3
    assert coverage([0.2, 0.3], threshold=0.25) == 1
