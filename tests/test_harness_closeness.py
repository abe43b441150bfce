"""The harness' closeness measures fail on what no tolerance makes equal (the JAX checks rest on them)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.closeness import max_rel, same

ONES = [np.ones(3), np.ones((2, 2))]


def test_equal_lists_are_zero_apart_and_a_relative_difference_is_measured():
    assert max_rel(ONES, [a.copy() for a in ONES]) == 0.0
    assert max_rel([np.array([1.1, 1.0])], [np.array([1.0, 1.0])]) == pytest.approx(0.1 - 1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_on_either_side_is_infinitely_far(bad):
    broken = [np.array([1.0, bad, 1.0]), np.ones((2, 2))]
    assert max_rel(broken, ONES) == float("inf")
    assert max_rel(ONES, broken) == float("inf")
    assert max_rel(broken, broken) == float("inf")  # NaN weights on both sides are still broken
    assert max_rel([bad], [1.0]) == float("inf")  # a loss list


def test_a_missing_element_or_another_shape_is_infinitely_far_and_not_the_same():
    assert max_rel(ONES[:1], ONES) == float("inf")
    assert max_rel(ONES, ONES[:1]) == float("inf")
    assert max_rel([np.ones(3)], [np.ones(4)]) == float("inf")
    assert not same(ONES[:1], ONES)
    assert same(ONES, [a.copy() for a in ONES])
    assert not same([np.ones(3)], [np.zeros(3)])
