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
    assert sem["purity"] == {0: 1.0, 1: 1.0, 2: 0.0} and sem["coverage"] == 2
