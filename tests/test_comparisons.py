"""The settled study's instruments: the stopping rule on synthetic escape curves, the across-base interval's coverage on data with a
known base variance, and the exact sign-flip p-value against plain enumeration."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from basedirected.comparisons import (across_base_interval, coverage, sign_flip_pvalue, variance_components,
                                      within_base_interval)
from basedirected.metrics import settled_strictly, settling


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


@given(rates=st.lists(st.floats(0.0, 3.0), min_size=10, max_size=10), losses=st.lists(st.floats(0.1, 5.0), min_size=10, max_size=10),
       aligned=st.lists(st.floats(0.0, 1.0), min_size=10, max_size=10), scale=st.floats(0.01, 100.0))
def test_the_stricter_rule_never_passes_a_run_the_rate_rule_fails_and_reads_the_loss_in_its_own_units(rates, losses, aligned, scale):
    T = 1000
    curve = [(100 * (i + 1), r) for i, r in enumerate(rates)]
    verdict = settling(curve, T, alignment=aligned, loss=losses)
    assert settled_strictly(verdict) in (True, False) and (verdict["settled"] or not settled_strictly(verdict))
    rescaled = settling(curve, T, alignment=aligned, loss=[scale * l for l in losses])  # the rule reads a share of the loss, not nats
    assert rescaled["loss_fall_last"] == pytest.approx(verdict["loss_fall_last"], rel=1e-9, abs=1e-12)
    assert settled_strictly(verdict) == (verdict["settled"] and max(aligned[7:]) - min(aligned[7:]) < 0.05 and (losses[7] - losses[9]) / losses[7] < 0.05)


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
    assert all(0.935 < c < 0.965 for name, c in without.items() if name != "the rule"), without
    assert with_base["the rule"] >= with_base["across bases"] and without["the rule"] > 0.97  # the one rule: never below the exact interval, wider where bases agree


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


# --- the rules every page applies: one function each ---------------------------------------------------------------

def _records(rng):
    "J_theta and dist on 3 bases x 4 seeds of one task and cell, one dist run unsettled."
    out = []
    for base, seed, obj in itertools.product(range(3), range(4), ("theta", "dist")):
        out.append({"key": f"k-{obj}-b{base}-s{seed}", "regime": "sorting", "latent": "discrete", "posterior": "exact", "K": 3, "objective": obj,
                    "alpha": 0.5, "gamma": 1.0, "tau_target": 0.07, "base_seed": base, "seed": seed, "settled": not (obj == "dist" and base == 1 and seed == 2),
                    "gen_alignment_controlled_all": float(rng.uniform(0.8, 1.0)), "gen_alignment_controlled_all_null": 0.36,
                    "gen_alignment_controlled_all_excess": float(rng.uniform(0.4, 0.6)), "gen_answer_rate": 0.99, "I_zs_norm": float(rng.uniform(0.5, 1)),
                    "gen_valid_rate": float(rng.uniform(0.9, 1.0)), "gate_valid_rate": 0.97})
    return out


def test_every_report_leaves_out_unsettled_runs_and_states_intervals_through_the_one_rule(monkeypatch):
    "paired statistics, success counts, base contrasts, variance components and the answer each call settled_runs; every across-base figure is contrast_interval's."
    import basedirected.reports as reports
    from basedirected.comparisons import contrast_interval, settled_runs
    calls = {"settled_runs": 0, "contrast_interval": 0}
    def spy(name, f):
        def wrapped(*a, **k): calls[name] += 1; return f(*a, **k)
        return wrapped
    monkeypatch.setattr(reports, "settled_runs", spy("settled_runs", settled_runs))
    monkeypatch.setattr(reports, "contrast_interval", spy("contrast_interval", contrast_interval))
    records = _records(np.random.default_rng(0))
    for report in (reports.paired_statistics, reports.success_counts, reports.success_parts, reports.base_contrasts, reports.metric_components, reports.answer_rows):
        before = dict(calls)
        rows = report(records)
        assert calls["settled_runs"] > before["settled_runs"], report.__name__
    contrasts = reports.base_contrasts(records, ("gen_alignment_controlled_all_excess",))
    (c,) = contrasts
    assert calls["contrast_interval"] > 0 and c["unsettled_left_out"] == 1 and c["n"] == 11
    by_base = {}
    for r in records:
        if r["objective"] == "theta" and not (r["base_seed"] == 1 and r["seed"] == 2):
            d = next(x for x in records if x["objective"] == "dist" and (x["base_seed"], x["seed"]) == (r["base_seed"], r["seed"]))
            by_base.setdefault(r["base_seed"], []).append(r["gen_alignment_controlled_all_excess"] - d["gen_alignment_controlled_all_excess"])
    rule = contrast_interval(by_base)
    assert (c["lo"], c["hi"], c["rule"]) == (rule["lo"], rule["hi"], rule["rule"])
    (a,) = [r for r in reports.answer_rows(records) if r["comparison"] == "theta - dist"]
    assert (a["lo"], a["hi"]) == (rule["lo"], rule["hi"]) and rule["rule"] in a["unit"]
    (s,) = [s for s in reports.success_counts(records) if s["objective"] == "dist"]
    assert (s["success_n"], s["unsettled"]) == (11, 1)
    before = calls["contrast_interval"]
    (p,) = [p for p in reports.success_parts(records) if p["objective"] == "dist"]
    cost = {}
    for r in records:
        if r["objective"] == "dist" and r["settled"]: cost.setdefault(r["base_seed"], []).append(r["gen_valid_rate"] - r["gate_valid_rate"])
    assert calls["contrast_interval"] > before and (p["runs"], p["unsettled"]) == (11, 1)
    assert (p["validity_cost_lo"], p["validity_cost_hi"]) == (contrast_interval(cost)["lo"], contrast_interval(cost)["hi"])
