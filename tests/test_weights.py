"""Token weights: identities 1, 2, 5, 7 of the foundation, against plain loops, on random masked batches."""
import math

import pytest
import torch
from hypothesis import given

from basedirected.weights import (MAX_GAMMA, concentration_factor, corrected_weights, inverse_surprisal_weights, reconstruction_weights,
                                  reference_weights, surprisal_share_weights, uniform_weights)
from reference_loops import inverse_weights_loop, weights_loop
from strategies import alphas, gammas, masked_batches

TOL = dict(rtol=1e-9, atol=1e-12)


def rows(x, lengths):
    return [x[i, :n].tolist() for i, n in enumerate(lengths)]


@given(masked_batches(), alphas, gammas)
def test_matches_plain_loop(batch, alpha, gamma):
    _, base, mask, lengths = batch
    rw = reference_weights(base, mask, alpha=alpha, gamma=gamma)
    for i, b in enumerate(rows(base, lengths)):
        u, w_tilde, kappa, w, a = weights_loop(b, alpha, gamma)
        n = lengths[i]
        for got, want in [(rw.uniform[i, :n], u), (rw.share[i, :n], w_tilde), (rw.corrected[i, :n], w), (rw.final[i, :n], a)]:
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), **TOL)
        assert math.isclose(rw.kappa[i].item(), kappa, rel_tol=1e-9)


@given(masked_batches(), gammas)
def test_identity_1_shares_sum_to_one_and_vanish_off_mask(batch, gamma):
    _, base, mask, _ = batch
    w = surprisal_share_weights(base, mask, gamma)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[0], dtype=torch.float64), **TOL)
    assert (w[mask == 0] == 0).all() and (w >= 0).all()


@given(masked_batches())
def test_identity_1_gamma_zero_is_uniform(batch):
    _, base, mask, _ = batch
    torch.testing.assert_close(surprisal_share_weights(base, mask, 0.0), uniform_weights(mask.bool(), torch.float64))


@given(masked_batches(), alphas, gammas)
def test_identity_2_base_scale(batch, alpha, gamma):
    _, base, mask, _ = batch
    rw = reference_weights(base, mask, alpha=alpha, gamma=gamma)
    torch.testing.assert_close((rw.corrected * rw.base_nll).sum(-1), rw.base_mean, **TOL)
    torch.testing.assert_close((rw.final * rw.base_nll).sum(-1), rw.base_mean, **TOL)


@given(masked_batches(), gammas)
def test_identity_5_kappa_at_least_one(batch, gamma):
    _, base, mask, _ = batch
    assert (concentration_factor(base, mask, gamma) >= 1 - 1e-12).all()


@given(masked_batches(), gammas)
def test_identity_5_alpha_one_is_uniform(batch, gamma):
    _, base, mask, _ = batch
    torch.testing.assert_close(reconstruction_weights(base, mask, 1.0, gamma), uniform_weights(mask.bool(), torch.float64))


@given(masked_batches(allow_zero=False))
def test_identity_5_gamma_to_infinity_is_argmax(batch):
    _, base, mask, lengths = batch
    w = surprisal_share_weights(base, mask, MAX_GAMMA)  # the largest gamma the package takes
    for i, b in enumerate(rows(base, lengths)):
        top = max(b)
        ties = [t for t, x in enumerate(b) if x == top]
        want = torch.zeros(base.shape[1], dtype=torch.float64)
        want[ties] = 1.0 / len(ties)
        if any(top * (1 - 0.02) <= x < top for x in b):  # (x/top)^gamma decays slowly for near-ties (0.98^1000 = 2e-9): skip them
            continue
        torch.testing.assert_close(w[i], want, rtol=0, atol=1e-6)


@given(masked_batches(), gammas)
def test_identity_7_inverse_ablation_restores_base_scale(batch, gamma):
    _, base, mask, lengths = batch
    rw = reference_weights(base, mask, gamma=gamma)
    torch.testing.assert_close((rw.inverse * rw.base_nll).sum(-1), rw.base_mean, **TOL)
    assert (rw.inverse_kappa <= 1 + 1e-12).all()
    v = inverse_surprisal_weights(base, mask, gamma)
    for i, b in enumerate(rows(base, lengths)):
        torch.testing.assert_close(v[i, :lengths[i]], torch.tensor(inverse_weights_loop(b, gamma, 1e-3)[2], dtype=torch.float64), **TOL)


def test_corrected_weights_do_not_sum_to_one_in_general():
    w = corrected_weights(torch.tensor([[0.1, 3.0]]), torch.ones(1, 2), 1.0)
    assert w.sum().item() < 1  # kappa > 1 shrinks them: the point is the base scale, not normalization


def test_zero_surprisal_edge_cases():
    b = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    m = torch.ones(2, 3)
    torch.testing.assert_close(surprisal_share_weights(b, m, 2.0), torch.tensor([[0, 0.5, 0.5], [1 / 3] * 3]))
    torch.testing.assert_close(concentration_factor(b, m, 2.0)[1], torch.tensor(1.0))
    torch.testing.assert_close(reconstruction_weights(b, m, 0.0, 2.0)[1], torch.full((3,), 1 / 3))


def test_tiny_negative_surprisal_is_clamped_and_clear_negative_rejected():
    w = surprisal_share_weights(torch.tensor([[-1e-7, 1.0]]), torch.ones(1, 2), 1.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="base_nll must be a surprisal"):
        surprisal_share_weights(torch.tensor([[-0.5, 1.0]]), torch.ones(1, 2), 1.0)


def test_precision_and_no_gradient():
    b = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) * 3
    m = torch.ones(3, 4)
    w16 = reconstruction_weights(b.bfloat16(), m, 0.5, 2.0)
    assert w16.dtype == torch.float32
    assert reconstruction_weights(b.double(), m, 0.5, 2.0).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wa = reconstruction_weights(b, m, 0.5, 2.0)
    assert wa.dtype == torch.float32
    torch.testing.assert_close(wa, reconstruction_weights(b, m, 0.5, 2.0))
    assert not reconstruction_weights(b.requires_grad_(), m, 0.5, 2.0).requires_grad


@pytest.mark.parametrize("kwargs, message", [
    (dict(alpha=-0.1), "alpha must lie in [0, 1]"),
    (dict(alpha=1.1), "alpha must lie in [0, 1]"),
    (dict(alpha=float("nan")), "alpha must be finite"),
    (dict(gamma=-1.0), "gamma must be >= 0"),
    (dict(gamma=float("inf")), "gamma must be finite"),
])
def test_bad_hyperparameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        reference_weights(torch.ones(1, 2), torch.ones(1, 2), **kwargs)


@pytest.mark.parametrize("base, mask, message", [
    (torch.ones(2, 3), torch.ones(2, 4), "base_nll has shape"),
    (torch.ones(2, 3), torch.full((2, 3), 0.5), "mask must be binary"),
    (torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2), "base_nll has NaN or inf"),
    (torch.tensor([[1.0, float("inf")]]), torch.ones(1, 2), "base_nll has NaN or inf"),
    (torch.ones(3, 2), torch.tensor([[1, 1], [0, 0], [0, 0]]), r"rows \[1, 2\]"),
    (torch.ones(2, dtype=torch.long).reshape(1, 2), torch.ones(1, 2), "base_nll must be a floating tensor"),
    (torch.ones(2), torch.ones(2), r"mask must have shape \(B, T\)"),
])
def test_bad_batches_are_named(base, mask, message):
    with pytest.raises(ValueError, match=message):
        reconstruction_weights(base, mask, 0.5, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device (CUDA)")
def test_device_mismatch_is_named():
    with pytest.raises(ValueError, match="base_nll is on"):
        reconstruction_weights(torch.ones(1, 2, device="cuda"), torch.ones(1, 2), 0.5, 1.0)


def test_device_mismatch_is_named_meta():
    with pytest.raises(ValueError, match="base_nll is on meta"):
        reconstruction_weights(torch.ones(1, 2, device="meta"), torch.ones(1, 2), 0.5, 1.0)
