"""KL terms, the loss configuration and its presets, the compared objectives, and J_theta / J_cELBO."""
import pytest
import torch
from hypothesis import given, strategies as st

from basedirected.distributions import categorical_kl, gaussian_kl
from basedirected.objective import (LOSS_PRESETS, OBJECTIVE_NAMES, ORIGINAL_FLAG_ALIASES, ReconstructionLossConfig, j_celbo, j_theta,
                                    objective, objectives)
from basedirected.reconstruction import TERM_NAMES, reconstruction_terms
from reference_loops import categorical_kl_loop

logit_lists = st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=6)


@given(st.data())
def test_categorical_kl_matches_loop_and_is_nonnegative(data):
    K = data.draw(st.integers(2, 6))
    q = data.draw(st.lists(st.floats(-8, 8, allow_nan=False), min_size=K, max_size=K))
    r = data.draw(st.lists(st.floats(-8, 8, allow_nan=False), min_size=K, max_size=K))
    got = categorical_kl(torch.tensor([q], dtype=torch.float64), torch.tensor([r], dtype=torch.float64)).item()
    assert got == pytest.approx(categorical_kl_loop(q, r), rel=1e-5, abs=1e-6)
    assert got >= -1e-6


def test_gaussian_kl_matches_torch_distributions_and_vanishes_at_equality():
    g = torch.Generator().manual_seed(0)
    mq, lq, mr, lr = (torch.randn(6, 4, generator=g) for _ in range(4))
    want = torch.distributions.kl_divergence(torch.distributions.Normal(mq, (lq / 2).exp()),
                                             torch.distributions.Normal(mr, (lr / 2).exp())).sum(-1)
    torch.testing.assert_close(gaussian_kl(mq, lq, mr, lr), want)
    torch.testing.assert_close(gaussian_kl(mq, lq, mq, lq), torch.zeros(6))
    with pytest.raises(ValueError, match="must share one shape"):
        gaussian_kl(mq, lq, mr[:, :2], lr)
    with pytest.raises(ValueError, match="mu_r has NaN or inf"):
        gaussian_kl(mq, lq, mr * float("nan"), lr)


def test_categorical_kl_handles_ruled_out_codes_and_rejects_bad_logits():
    ruled_out = torch.tensor([[0.0, 1.0, float("-inf")]])
    assert categorical_kl(ruled_out, ruled_out).item() == pytest.approx(0.0, abs=1e-7)
    assert categorical_kl(ruled_out, torch.zeros(1, 3)).item() == pytest.approx(categorical_kl_loop([0.0, 1.0, -1e30], [0.0, 0.0, 0.0]), rel=1e-5)
    for bad, message in [(torch.tensor([[float("nan"), 0.0]]), "q_logits has NaN"), (torch.zeros(2, 0), "K >= 1")]:
        with pytest.raises(ValueError, match=message):
            categorical_kl(bad, torch.zeros_like(bad))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 5, generator=g) * 2, torch.rand(4, 5, generator=g) * 2 + 0.05, torch.ones(4, 5), torch.rand(4, generator=g)


@pytest.mark.parametrize("alpha, gamma", [(0.0, 1.0), (0.3, 2.0), (1.0, 0.5)])
def test_base_directed_preset_is_j_theta(alpha, gamma):
    nll, base, mask, kl = _batch()
    out = objective(nll, base, mask, 1.1, kl, 0.7, ReconstructionLossConfig.theta(alpha, gamma=gamma))
    torch.testing.assert_close(out["loss"], j_theta(out, kl, 0.7))


def test_celbo_preset_is_j_celbo_and_every_term_is_always_returned():
    nll, base, mask, kl = _batch()
    for preset in LOSS_PRESETS:
        out = objective(nll, base, mask, 1.1, kl, 0.7, getattr(ReconstructionLossConfig, preset)())
        assert set(TERM_NAMES) | {"kl", "recon", "loss"} <= set(out), preset
    out = objective(nll, base, mask, 1.1, kl, 0.7, ReconstructionLossConfig.celbo())
    torch.testing.assert_close(out["loss"], j_celbo(out, kl, 0.7))


def test_combine_is_the_linear_stack():
    nll, base, mask, _ = _batch()
    cfg = ReconstructionLossConfig(lambda_std=0.5, lambda_ex=2.0, lambda_tok=0.25, lambda_inv_tok=1.5, gamma=2.0)
    t = reconstruction_terms(nll, base, mask, 1.1, gamma=2.0)
    torch.testing.assert_close(cfg.combine(t), 0.5 * t["std"] + 2.0 * t["ex"] + 0.25 * t["tok"] + 1.5 * t["inv_tok"])


def test_kl_for_loss_replaces_only_the_optimized_kl():
    nll, base, mask, kl = _batch()
    floored = kl.clamp_min(0.5)
    out = objective(nll, base, mask, 1.1, kl, 2.0, ReconstructionLossConfig.celbo(), kl_for_loss=floored)
    torch.testing.assert_close(out["kl"], kl.mean())
    torch.testing.assert_close(out["loss"], out["std"] + 2.0 * floored.mean())


@pytest.mark.parametrize("kwargs, message", [
    (dict(lambda_dist=-0.1), "lambda_dist must be >= 0"),
    (dict(lambda_std=float("nan")), "lambda_std must be finite"),
    (dict(), "at least one reconstruction weight"),
    (dict(lambda_std=1.0, alpha=1.5), r"alpha must lie in \[0, 1\]"),
    (dict(lambda_std=1.0, gamma=-2.0), "gamma must be >= 0"),
    (dict(lambda_std=1.0, token_reduction="max"), "token_reduction"),
])
def test_config_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReconstructionLossConfig(**kwargs)


def test_objective_rejects_bad_kl_and_beta():
    nll, base, mask, kl = _batch()
    cfg = ReconstructionLossConfig.celbo()
    with pytest.raises(ValueError, match="kl must have shape"):
        objective(nll, base, mask, 1.0, kl[:2], 1.0, cfg)
    with pytest.raises(ValueError, match="kl has NaN"):
        objective(nll, base, mask, 1.0, kl * float("nan"), 1.0, cfg)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        objective(nll, base, mask, 1.0, kl, -1.0, cfg)


def test_alias_table_maps_onto_config_fields():
    fields = set(ReconstructionLossConfig.__dataclass_fields__)
    assert {f.field for f in ORIGINAL_FLAG_ALIASES.values()} <= fields
    assert ORIGINAL_FLAG_ALIASES["--token-weighted-reconstruction-alpha"].field == "gamma"


def test_every_term_has_a_preset_and_an_objective_of_its_name():
    assert set(LOSS_PRESETS) == {"celbo"} | set(TERM_NAMES) - {"std"}
    assert set(LOSS_PRESETS) <= set(OBJECTIVE_NAMES) == set(objectives())
    for name in LOSS_PRESETS:  # the objective of a term's name trains with that term's preset
        assert objectives()[name].loss == getattr(ReconstructionLossConfig, name)(**({"gamma": 1.0} if name in ("tok", "tok_cc", "inv_tok") else {})), name


def test_presets_keep_their_own_alpha_unless_given():
    assert ReconstructionLossConfig.tok_cc().alpha == 0.0
    assert ReconstructionLossConfig.tok_cc(alpha=0.3).alpha == 0.3
    assert ReconstructionLossConfig.theta(0.2).lambda_dist == 0.2
