"""The settled study's instruments: the stopping rule on synthetic escape curves, the across-base interval's coverage on data with a
known base variance, and the exact sign-flip p-value against plain enumeration."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from basedirected.comparisons import (across_base_interval, coverage, sign_flip_pvalue, variance_components,
                                      within_base_interval)
from basedirected.metrics import settling


def escape(step, at, height, width=40.0):
    "A held-out rate that rises from 0 to `height` around step `at`."
    return height / (1 + math.exp(-(step - at) / width))


def test_a_plateau_settles_and_a_late_second_escape_does_not():
    T = 800
    plateau = [(s, escape(s, 150, 1.1)) for s in range(80, T + 1, 80)]
    late = [(s, escape(s, 150, 0.7) + escape(s, 720, 0.4, width=20)) for s in range(80, T + 1, 80)]  # a second code takes a strategy late
    assert settling(plateau, T)["settled"] and settling(plateau, T)["rate_range_last"] < 1e-3
    verdict = settling(late, T)
    assert not verdict["settled"] and verdict["rate_range_last"] > 0.3 and verdict["settle_window_from"] == 640
    # the tolerance is the rule's: just below it settles, just above it does not
    flat = [(s, 1.0) for s in range(80, T + 1, 80)]
    assert settling([*flat[:-1], (T, 1.0 + 0.019)], T)["settled"] and not settling([*flat[:-1], (T, 1.0 + 0.021)], T)["settled"]


def test_the_rule_refuses_a_curve_it_cannot_judge():
    with pytest.raises(ValueError, match="no evaluation at or before step 800"):
        settling([(900, 1.0), (1000, 1.0)], 1000)
    with pytest.raises(ValueError, match="last step 1000"):
        settling([(500, 1.0), (900, 1.0)], 1000)
    with pytest.raises(ValueError, match="not finite"):
        settling([(500, 1.0), (1000, float("nan"))], 1000)


def test_the_across_base_interval_covers_95_percent_with_a_known_base_variance():
    "Three bases x four seeds, base and seed standard deviations equal: the t interval over base means keeps its level, the seed-only ones do not."
    with_base = coverage(0.1, 0.1, bases=3, seeds=4, repetitions=3000, seed=1)
    assert 0.935 < with_base["across bases"] < 0.965, with_base
    assert with_base["seeds as one sample"] < 0.85 and with_base["within base"] < 0.85, with_base
    without = coverage(0.0, 0.1, bases=3, seeds=4, repetitions=3000, seed=2)
    assert all(0.935 < c < 0.965 for c in without.values()), without


def test_the_intervals_and_components_on_a_hand_case():
    by_base = {0: [1.0, 3.0], 1: [2.0, 4.0], 2: [6.0, 8.0]}  # base means 2, 3, 7; within-base deviations +-1
    w, a = within_base_interval(by_base), across_base_interval(by_base)
    assert w["mean"] == a["mean"] == 4.0
    assert w["df"] == 3 and math.isclose(w["se"], math.sqrt(2.0 * (3 / 2)) / 3)       # pooled s^2 = 6 / 3 = 2
    assert a["df"] == 2 and math.isclose(a["se"], math.sqrt(7.0 / 3))                 # var of (2, 3, 7) = 7, over 3 bases
    vc = variance_components(by_base)
    assert math.isclose(vc["var_seed_anova"], 2.0) and math.isclose(vc["var_base_anova"], (2 * 7.0 - 2.0) / 2)
    assert math.isclose(vc["var_seed"], 2.0, rel_tol=1e-3) and math.isclose(vc["var_base"], 6.0, rel_tol=1e-3)  # balanced: REML = ANOVA


@given(st.lists(st.floats(-5, 5, allow_nan=False).map(lambda v: round(v, 3)), min_size=1, max_size=9))
def test_sign_flip_pvalue_equals_enumeration(d):
    hits = [abs(sum(s * x for s, x in zip(signs, d))) >= abs(sum(d)) - 1e-9 for signs in itertools.product((1, -1), repeat=len(d))]
    assert sign_flip_pvalue(d) == pytest.approx(sum(hits) / len(hits))
    assert sign_flip_pvalue(d) >= 2 / 2 ** len(d) - 1e-15


def test_sign_flip_floor_and_refusals():
    assert sign_flip_pvalue([0.1] * 12) == 2 / 4096
    with pytest.raises(ValueError, match="at most 20"): sign_flip_pvalue(np.ones(21))
    with pytest.raises(ValueError, match="finite"): sign_flip_pvalue([1.0, float("inf")])
