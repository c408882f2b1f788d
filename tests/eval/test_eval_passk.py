"""The unbiased pass@k estimator against its combinatorial definition."""

from __future__ import annotations

import itertools
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megacpp.errors import ConfigError
from megacpp.eval import mean_pass_at_k, pass_at_k


def by_definition(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


def by_enumeration(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 6), (7, 7, 2)])
def test_matches_enumeration_of_all_subsets(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(by_enumeration(n, c, k))


@given(st.integers(1, 200).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_the_binomial_formula(args):
    n, c, k = args
    assert pass_at_k(n, c, k) == pytest.approx(by_definition(n, c, k), abs=1e-12)


def test_known_values():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    assert pass_at_k(200, 0, 100) == 0.0
    assert pass_at_k(200, 101, 100) == 1.0  # any 100 of 200 must include a correct one
    assert pass_at_k(1000, 1, 100) == pytest.approx(0.1)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_out_of_range_arguments_are_refused(n, c, k):
    with pytest.raises(ConfigError):
        pass_at_k(n, c, k)


def test_mean_over_problems_leaves_out_k_larger_than_n():
    counts = {"a": (10, 10), "b": (10, 0), "c": (20, 5)}
    table = mean_pass_at_k(counts, [1, 10, 100])
    assert set(table) == {1, 10}
    assert table[1] == pytest.approx((1.0 + 0.0 + 0.25) / 3)
    assert table[10] == pytest.approx((1.0 + 0.0 + by_definition(20, 5, 10)) / 3)
    with pytest.raises(ConfigError):
        mean_pass_at_k({}, [1])
