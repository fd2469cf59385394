"""Reconstruction terms: plain-loop agreement, identities 3, 4, 6, the aggregation family, and bad input."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from basedirected.reconstruction import (TERM_NAMES, TERM_SPECS, aggregate, policy_matched_scale, reconstruction_terms,
                                         resolve_term)
from basedirected.weights import reference_weights
from reference_loops import terms_loop
from strategies import alphas, gammas, masked_batches

c_refs = st.floats(0.05, 10.0, allow_nan=False)


def rows(x, lengths):
    return [x[i, :n].tolist() for i, n in enumerate(lengths)]


@given(masked_batches(), c_refs, alphas, gammas)
def test_every_term_matches_plain_loop(batch, c_ref, alpha, gamma):
    nll, base, mask, lengths = batch
    terms = reconstruction_terms(nll, base, mask, c_ref, alpha=alpha, gamma=gamma)
    want = terms_loop(rows(nll, lengths), rows(base, lengths), c_ref, alpha, gamma)
    assert set(TERM_NAMES) <= set(terms)
    for k in TERM_NAMES:
        assert terms[k].dim() == 0
        assert math.isclose(terms[k].item(), want[k], rel_tol=1e-9, abs_tol=1e-12), (k, terms[k].item(), want[k])


@given(masked_batches(), c_refs, alphas, gammas)
def test_identity_4_theta_is_a_point_in_the_stack(batch, c_ref, alpha, gamma):
    nll, base, mask, _ = batch
    t = reconstruction_terms(nll, base, mask, c_ref, alpha=alpha, gamma=gamma)
    torch.testing.assert_close(t["theta"], alpha * t["dist"] + (1 - alpha) * t["tok_cc"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(t["dist"], t["std"] / c_ref, rtol=1e-12, atol=0)


@given(masked_batches(), c_refs, alphas, gammas)
def test_identity_6_gradient_is_weight_over_c_and_batch(batch, c_ref, alpha, gamma):
    nll, base, mask, _ = batch
    leaf = nll.nan_to_num(0.0).requires_grad_()
    reconstruction_terms(leaf, base, mask, c_ref, alpha=alpha, gamma=gamma)["theta"].backward()
    a = reference_weights(base, mask, alpha=alpha, gamma=gamma).final
    torch.testing.assert_close(leaf.grad, a / (c_ref * nll.shape[0]), rtol=1e-9, atol=1e-15)
    assert (leaf.grad[mask == 0] == 0).all()


def test_identity_6_difference_keeps_gradient_ratio_rescales_it():
    l = torch.tensor([0.7, 1.3], requires_grad=True)
    b, eps = torch.tensor([0.5, 2.0]), 1e-6
    (l - b).sum().backward()
    torch.testing.assert_close(l.grad, torch.ones(2))
    l.grad = None
    (l / (b + eps)).sum().backward()
    torch.testing.assert_close(l.grad, 1 / (b + eps))


def _markov_base_sample(n, seed, T=6, V=5):
    "Exact surprisals of y ~ p_theta(.|x) for a fixed random first-order Markov base model."
    P = torch.softmax(2 * torch.randn(V, V, generator=torch.Generator().manual_seed(123)), -1)
    gen = torch.Generator().manual_seed(seed)
    prev, out = torch.randint(0, V, (n,), generator=gen), []
    for _ in range(T):
        y = torch.multinomial(P[prev], 1, generator=gen).squeeze(-1)
        out.append(-torch.log(P[prev, y]))
        prev = y
    return torch.stack(out, -1).double()


@pytest.mark.parametrize("alpha, gamma", [(0.0, 1.0), (0.5, 2.0), (1.0, 0.0), (0.2, 4.0)])
def test_identity_3_monte_carlo_base_units(alpha, gamma):
    fit, test = _markov_base_sample(20000, 1), _markov_base_sample(20000, 2)
    c_hat = fit.mean().item()
    c_se = fit.mean(-1).std().item() / math.sqrt(fit.shape[0])
    ones = torch.ones_like(test)
    r = reconstruction_terms(test, test, ones, c_hat, alpha=alpha, gamma=gamma)["theta"].item()
    per_example = test.mean(-1) / c_hat
    se = per_example.std().item() / math.sqrt(test.shape[0])
    assert abs(r - 1) < 4 * math.hypot(se, c_se / c_hat), r


def test_aggregate_is_the_family_and_rejects_bad_weights():
    nll = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    pi = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    omega = torch.tensor([2.0, 0.5])
    want = (2.0 * (0.25 + 1.5) + 0.5 * 3.0) / 2 / 4.0
    torch.testing.assert_close(aggregate(nll, pi, mask, omega, 4.0), torch.tensor(want))
    with pytest.raises(ValueError, match="example_weight must have shape"):
        aggregate(nll, pi, mask, torch.ones(3))
    with pytest.raises(ValueError, match="scale must be > 0"):
        aggregate(nll, pi, mask, None, 0.0)


def test_every_named_term_is_resolved_from_the_table():
    base = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) + 0.1
    nll = torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 5)
    rw = reference_weights(base, mask, alpha=0.3, gamma=2.0)
    terms = reconstruction_terms(nll, base, mask, 1.7, alpha=0.3, gamma=2.0, weights=rw)
    for name, spec in TERM_SPECS.items():
        pi, omega, C = resolve_term(spec, rw, 1.7)
        torch.testing.assert_close(terms[name], aggregate(nll, pi, mask, omega, C))


def test_token_sum_changes_std_only_when_lengths_vary():
    nll = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    base = torch.ones(2, 3)
    ragged = torch.tensor([[1, 1, 1], [1, 0, 0]])
    s = reconstruction_terms(nll, base, ragged, 1.0, token_reduction="sum")
    m = reconstruction_terms(nll, base, ragged, 1.0, token_reduction="mean")
    assert s["std"].item() == pytest.approx((3.0 + 2.0) / 2) and m["std"].item() == pytest.approx((1.0 + 2.0) / 2)
    assert s["dist"].item() == m["dist"].item()  # c_theta is a per-token scale: dist stays a mean


def test_policy_matched_scale_equals_c_for_theta():
    base = _markov_base_sample(4000, 3)
    ones = torch.ones_like(base)
    assert policy_matched_scale("theta", base, ones, alpha=0.3, gamma=2.0) == pytest.approx(base.mean().item(), rel=1e-9)
    assert policy_matched_scale("tok", base, ones, gamma=2.0) > base.mean().item()  # kappa >= 1 inflates the raw scale
    with pytest.raises(ValueError, match="term must be one of"):
        policy_matched_scale("nope", base, ones)


@pytest.mark.parametrize("mutate, message", [
    (dict(c_ref=0.0), "c_ref must be > 0"),
    (dict(c_ref=-1.0), "c_ref must be > 0"),
    (dict(c_ref=float("inf")), "c_ref must be finite"),
    (dict(alpha=3.0), r"alpha must lie in \[0, 1\]"),
    (dict(gamma=-0.5), "gamma must be >= 0"),
    (dict(token_reduction="median"), "token_reduction"),
    (dict(ex_floor=0.0), "ex_floor must be > 0"),
])
def test_bad_arguments_are_named(mutate, message):
    g = torch.Generator().manual_seed(0)
    kwargs = dict(nll=torch.rand(2, 3, generator=g), base_nll=torch.rand(2, 3, generator=g), mask=torch.ones(2, 3), c_ref=1.0)
    kwargs.update(mutate)
    with pytest.raises(ValueError, match=message):
        reconstruction_terms(**kwargs)


def test_nan_in_nll_on_mask_is_rejected_but_padding_nan_is_ignored():
    base, mask = torch.ones(1, 3), torch.tensor([[1, 1, 0]])
    ok = reconstruction_terms(torch.tensor([[1.0, 2.0, float("nan")]]), base, mask, 1.0)
    assert all(torch.isfinite(v) for v in ok.values())
    with pytest.raises(ValueError, match="nll has NaN or inf"):
        reconstruction_terms(torch.tensor([[float("nan"), 2.0, 0.0]]), base, mask, 1.0)


def test_bf16_nll_gives_float32_terms_under_autocast():
    g = torch.Generator().manual_seed(0)
    nll, base = torch.rand(3, 4, generator=g), torch.rand(3, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t = reconstruction_terms(nll.bfloat16(), base.bfloat16(), torch.ones(3, 4), 0.5)
    assert all(v.dtype == torch.float32 for v in t.values())
