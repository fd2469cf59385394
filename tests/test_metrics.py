"""Metrics on cases with known answers."""
import math

import pytest
import torch

from basedirected.metrics import (active_units, aggregate_posterior_information, code_perplexity, code_semantics, entropy,
                                  information_gain, latent_information, linear_probe_accuracy, strategy_information)


def test_perfect_posterior_carries_the_whole_strategy():
    s = torch.arange(3).repeat(100)
    q = torch.eye(3)[s]
    assert strategy_information(q, s) == pytest.approx(1.0)
    assert strategy_information(q, s, normalized=False) == pytest.approx(math.log(3))
    assert latent_information(q) == pytest.approx(math.log(3))
    assert code_perplexity(q) == pytest.approx(3.0)


def test_inert_posterior_carries_nothing():
    s = torch.arange(3).repeat(100)
    q = torch.full((300, 5), 0.2)
    assert strategy_information(q, s) == pytest.approx(0.0, abs=1e-7)  # float32 0.2 is inexact
    assert latent_information(q) == pytest.approx(0.0, abs=1e-7)
    assert code_perplexity(q) == pytest.approx(5.0)


def test_information_not_about_the_strategy_is_told_apart():
    s = torch.arange(3).repeat(200)
    q = torch.eye(2)[torch.arange(600) // 3 % 2]
    assert strategy_information(q, s) == pytest.approx(0.0, abs=1e-9)
    assert latent_information(q) == pytest.approx(math.log(2))


def test_swapped_codes_do_not_change_information():
    s = torch.arange(3).repeat(100)
    q = torch.eye(3)[s]
    assert strategy_information(q[:, [2, 0, 1]], s) == pytest.approx(strategy_information(q, s))


def test_entropy_handles_zeros():
    assert entropy(torch.tensor([1.0, 0.0])).item() == 0.0


def test_continuous_information_active_units_and_probe():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (500,), generator=g)
    mu = torch.eye(3)[labels] * 5 + 0.1 * torch.randn(500, 3, generator=g)
    per_class = torch.eye(3)[labels] * 5  # identical posteriors within a class: z tells the class, nothing more
    h = -sum(p * math.log(p) for p in (torch.bincount(labels) / 500).tolist())
    assert aggregate_posterior_information(per_class, torch.full((500, 3), -6.0)) == pytest.approx(h, rel=0.02)
    # with per-example jitter larger than the posterior width, z identifies the record itself (up to log N)
    assert aggregate_posterior_information(mu, torch.full((500, 3), -6.0)) > 2 * h
    assert active_units(mu) == 3 and active_units(torch.zeros(500, 4)) == 0
    assert linear_probe_accuracy(mu, labels) > 0.95


def test_negative_aggregate_information_warns():
    with pytest.warns(UserWarning, match="negative"):
        for seed in range(20):  # an unused latent: the estimate fluctuates around 0, sometimes below
            aggregate_posterior_information(torch.zeros(50, 2), torch.zeros(50, 2), seed=seed)


def test_information_gain_and_semantics():
    assert information_gain(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0])) == {"gain_abs": 0.5, "gain_frac": 0.5}
    sem = code_semantics({0: [1, 1, 1], 1: [2, 2, -1], 2: [-1, -1]})
    assert sem["code_purity"] == {0: 1.0, 1: 1.0, 2: 0.0} and sem["coverage"] == 2


# --- chance levels, denominators, K > S, answers on valid traces, intervals (notebook 08) ---

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from basedirected.metrics import (alignment_many_to_one, alignment_null, alignment_one_to_one, alignment_record, contingency_tables,
                                  generation_metrics, generation_scores, matched_records, permutation_tables)
from basedirected.tasks import TaskCheck, rate_record, wilson_interval


@pytest.mark.parametrize("counts, one_to_one, many_to_one", [
    (np.eye(3) * 7, 1.0, 1.0),                                  # K = S, perfect
    (np.ones((3, 3)), 1 / 3, 1 / 3),                            # K = S, codes independent of strategies
    (np.repeat(np.eye(3), 2, axis=0) * 5, 0.5, 1.0),            # K = 2S, two codes per strategy: one-to-one loses half
    ([[5, 0], [5, 0], [0, 10]], 0.75, 1.0),                     # K > S
    ([[6, 2, 2]], 0.6, 0.6),                                    # K = 1 < S: the majority share
    ([[3, 1, 0, 0], [0, 2, 2, 1]], 5 / 9, 5 / 9),               # K < S
    (np.zeros((3, 3)), 0.0, 0.0),                               # nothing counted
])
def test_alignment_and_purity_on_hand_made_tables(counts, one_to_one, many_to_one):
    assert alignment_one_to_one(counts) == pytest.approx(one_to_one)
    assert alignment_many_to_one(counts) == pytest.approx(many_to_one)


def test_unclassified_generations_count_against_the_all_generation_score():
    table = np.eye(3) * 10
    assert alignment_one_to_one(table) == 1.0
    assert alignment_one_to_one(table, unclassified=[0, 0, 10]) == pytest.approx(0.75)
    assert alignment_many_to_one(table, unclassified=[10, 10, 10]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one count per code"):
        alignment_one_to_one(table, unclassified=[1])


tables = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1)


@settings(max_examples=40, deadline=None)
@given(table=tables)
def test_the_null_lies_between_the_margins_bounds_and_one_to_one_never_beats_purity(table):
    N = np.array(table, dtype=float)
    null = alignment_null(N, n_samples=300)
    for rule in ("one_to_one", "many_to_one"):
        assert -1e-12 <= null[rule] <= 1 + 1e-12
    assert matched_records(N, "one_to_one") <= matched_records(N, "many_to_one") + 1e-9
    assert null["one_to_one"] <= null["many_to_one"] + 1e-9
    n = N.sum()
    if n:  # purity is at least the largest strategy's share, under the null as in any table
        assert null["many_to_one"] >= N.sum(0).max() / n - 1e-9


@settings(max_examples=25, deadline=None)
@given(table=tables)
def test_the_exact_null_is_invariant_to_relabelling_codes_and_strategies(table):
    N = np.array(table, dtype=float)
    # alignment_null enumerates the table with its unclassified column (zero here) when few enough: both orientations must be exact
    exact = lambda M: contingency_tables(M.sum(1), np.append(M.sum(0), 0), limit=5000) is not None
    if not (exact(N) and exact(N[::-1, ::-1])):
        return
    a = alignment_null(N)
    b = alignment_null(N[::-1, ::-1])
    assert a == pytest.approx(b, abs=1e-9)


def test_a_collapsed_posterior_has_zero_excess_whatever_the_strategy_shares():
    for shares in ([40, 10, 14], [5, 5, 5], [0, 64, 0]):
        collapsed = np.zeros((3, 3)); collapsed[1] = shares  # every record on code 1
        rec = alignment_record(collapsed, table="posterior")
        assert rec["alignment_posterior_excess"] == pytest.approx(0, abs=1e-12)
        assert rec["purity_posterior_excess"] == pytest.approx(0, abs=1e-12)


def test_a_perfect_table_has_excess_one_minus_its_null():
    perfect = np.diag([30.0, 20, 14])
    rec = alignment_record(perfect, table="posterior")
    assert rec["alignment_posterior"] == 1.0
    assert rec["alignment_posterior_excess"] == pytest.approx(1 - rec["alignment_posterior_null"])
    assert 1 / 3 < rec["alignment_posterior_null"] < 0.6  # chance here is more than 1/S


def test_the_simulated_null_agrees_with_exact_enumeration():
    N = np.array([[4, 1, 0], [1, 3, 1], [0, 2, 3]])
    exact = alignment_null(N)
    simulated = alignment_null(N, n_samples=40000, exact_limit=0, seed=3)
    for rule in ("one_to_one", "many_to_one"):
        assert simulated[rule] == pytest.approx(exact[rule], abs=0.004)
    draws = permutation_tables(N.sum(1), N.sum(0), 20000, seed=0)
    T, p = contingency_tables(N.sum(1), N.sum(0))
    assert p.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(draws.mean(0), (p[:, None, None] * T).sum(0), atol=0.03)


def test_codes_that_carry_nothing_score_above_one_third_but_have_no_excess():
    rng = np.random.default_rng(0)
    align, excess = [], []
    for trial in range(60):
        codes, strategies = np.repeat(np.arange(3), 24), rng.integers(0, 3, 72)
        N = np.zeros((3, 3)); np.add.at(N, (codes, strategies), 1)
        a = alignment_one_to_one(N); align.append(a)
        excess.append(a - alignment_null(N, n_samples=500, seed=trial)["one_to_one"])
    assert np.mean(align) > 0.38  # 1/3 would read this as above chance
    assert abs(np.mean(excess)) < 3 * np.std(excess, ddof=1) / np.sqrt(len(excess))


def test_answers_after_invalid_traces_are_not_solved_tasks():
    good, garbage_right = TaskCheck(True, (0,), True), TaskCheck(False, (), True)
    forced = [[TaskCheck(True, (k,), True)] * 8 for k in range(3)]
    g = generation_scores([good] * 3 + [garbage_right], forced, 3)
    assert (g["answer_rate"], g["answer_only_rate"], g["valid_rate"]) == (0.75, 1.0, 0.75)
    assert g["answer_rate_n"] == 4 and g["answer_rate_lo"] < 0.75 < g["answer_rate_hi"]


def test_a_model_writing_garbage_under_one_code_is_not_rewarded_by_the_all_generation_alignment():
    ok = lambda s: TaskCheck(True, (s,), True)
    forced = [[ok(0)] * 32, [ok(1)] * 32, [TaskCheck(False, (), False)] * 32]
    g = generation_scores([ok(0)], forced, 3)
    assert g["alignment_controlled"] == 1.0                                # classified only: looks perfect
    assert g["alignment_controlled_all"] == pytest.approx(2 / 3)           # every generation: the garbage counts
    assert g["classified_share"] == pytest.approx(2 / 3)
    assert g["coverage_mean"] == pytest.approx(2 / 3)


def test_an_inert_cvae_through_the_real_generation_code_has_no_controlled_excess():
    """An inert-initialized CVAE (every code the <znull> embedding): forced codes write the same distribution, so its
    codes carry nothing; across sampling seeds its excess over the null averages 0 while its raw alignment sits above 1/3."""
    from basedirected.base import BaseTrainConfig, pretrain_base
    from basedirected.cvae import CVAEConfig, build_cvae
    from basedirected.model import ModelConfig
    from basedirected.tasks import Vocab, make_splits
    from basedirected.visiting_order import VisitingOrder
    task = VisitingOrder.early()
    vocab = Vocab.for_task(task)
    train, held = make_splits(task, 2000, 64, seed=0)
    base, _ = pretrain_base(vocab, train, BaseTrainConfig(model=ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64), steps=150), seed=0)
    model = build_cvae(base, vocab, CVAEConfig(K=3))
    runs = [generation_metrics(model, held, task, n_routed=8, n_forced=24, seed=s) for s in range(6)]
    excess = [g["alignment_controlled_all_excess"] for g in runs]
    raw = [g["alignment_controlled_all"] for g in runs]
    assert abs(np.mean(excess)) < 0.05 and np.mean(raw) - np.mean([g["alignment_controlled_all_null"] for g in runs]) < 0.05
    assert all(g["alignment_controlled_all_n"] == 72 for g in runs)


def test_rates_carry_counts_and_wilson_intervals():
    lo, hi = wilson_interval(31, 32)
    assert lo < 0.98 < hi                       # cannot decide a 0.98 gate
    assert wilson_interval(256, 256)[0] > 0.98  # can
    r = rate_record("valid_rate", 9, 10)
    assert r["valid_rate"] == 0.9 and r["valid_rate_n"] == 10 and r["valid_rate_lo"] < 0.9 < r["valid_rate_hi"]
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(-1, 3)
