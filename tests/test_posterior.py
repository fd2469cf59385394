"""The exact discrete posterior, the break-even beta, alignment metrics, and the cELBO(beta c) control."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from basedirected.cvae import exact_objective, exact_posterior_logits
from basedirected.distributions import categorical_kl
from basedirected.metrics import alignment_one_to_one, break_even_beta
from basedirected.objective import ReconstructionLossConfig
from basedirected.runs import load_run, read_log
from basedirected.config import build_parser, config_from_args
from basedirected.train import run
from basedirected.visiting_order import VisitingOrder

TINY = ["--task", "visiting_order", "--posterior", "amortized", "--n-train", "600", "--n-eval", "32", "--c-samples", "64", "--base-steps", "40", "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--d-ff", "64", "--K", "3", "--steps", "8", "--batch-size", "8", "--eval-every", "4", "--checkpoint-every", "4", "--allow-failed-base"]


def J(q, L, r_logits, beta):
    "sum_k q_k L_k + beta KL(q || r) for probability rows q."
    return (q * L).sum(-1) + beta * (q * (q.clamp_min(1e-300).log() - torch.log_softmax(r_logits, -1))).sum(-1)


@given(st.integers(2, 6), st.floats(0.05, 5.0), st.integers(0, 10_000))
def test_q_star_minimizes_the_objective_over_q(K, beta, seed):
    g = torch.Generator().manual_seed(seed)
    L, r = torch.rand(4, K, generator=g, dtype=torch.float64) * 4, torch.randn(4, K, generator=g, dtype=torch.float64) * 2
    q_star = exact_posterior_logits(L, r, beta).double().softmax(-1)
    torch.testing.assert_close(J(q_star, L, r, beta), exact_objective(L, r, beta).double())
    others = torch.distributions.Dirichlet(torch.ones(K, dtype=torch.float64)).sample((64, 4))
    assert (J(others, L, r, beta) >= J(q_star, L, r, beta) - 1e-9).all()


def test_q_star_matches_gradient_descent_on_q():
    g = torch.Generator().manual_seed(0)
    L, r = torch.rand(3, 4, generator=g, dtype=torch.float64) * 3, torch.randn(3, 4, generator=g, dtype=torch.float64)
    logits = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([logits], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")
    def closure():
        opt.zero_grad(); loss = J(logits.softmax(-1), L, r, 0.3).sum(); loss.backward(); return loss
    opt.step(closure)
    torch.testing.assert_close(logits.detach().softmax(-1), exact_posterior_logits(L, r, 0.3).double().softmax(-1), atol=1e-6, rtol=0)


def test_exact_objective_equals_brute_force_enumeration_of_posteriors():
    g = torch.Generator().manual_seed(1)
    L, r = torch.rand(5, 2, generator=g, dtype=torch.float64) * 2, torch.randn(5, 2, generator=g, dtype=torch.float64)
    grid = torch.linspace(1e-6, 1 - 1e-6, 20001, dtype=torch.float64)
    q = torch.stack([grid, 1 - grid], -1)  # every posterior of a binary latent, finely
    brute = J(q[None], L[:, None], r[:, None], 0.7).min(-1).values
    torch.testing.assert_close(brute, exact_objective(L, r, 0.7).double(), atol=1e-7, rtol=0)


def test_stop_gradient_q_star_gives_the_closed_forms_gradient():
    g = torch.Generator().manual_seed(2)
    L0, r0 = torch.rand(4, 3, generator=g), torch.randn(4, 3, generator=g)
    L1, r1 = L0.clone().requires_grad_(), r0.clone().requires_grad_()
    exact_objective(L1, r1, 0.4).sum().backward()
    L2, r2 = L0.clone().requires_grad_(), r0.clone().requires_grad_()
    q_logits = exact_posterior_logits(L2, r2, 0.4)
    ((q_logits.softmax(-1) * L2).sum(-1) + 0.4 * categorical_kl(q_logits, r2)).sum().backward()
    torch.testing.assert_close(L2.grad, L1.grad, rtol=1e-5, atol=1e-6); torch.testing.assert_close(r2.grad, r1.grad, rtol=1e-5, atol=1e-6)


def test_beta_zero_picks_the_best_code():
    L = torch.tensor([[0.3, 0.1, 0.2]])
    assert exact_posterior_logits(L, torch.zeros(1, 3), 0.0).softmax(-1).tolist() == [[0.0, 1.0, 0.0]]
    assert exact_objective(L, torch.zeros(1, 3), 0.0).item() == pytest.approx(0.1)


@pytest.mark.parametrize("posterior", ["exact", "exact+distill"])
def test_exact_posterior_runs_train_log_and_resume(tmp_path, posterior):
    cfg = config_from_args(build_parser().parse_args([*TINY, "--posterior", posterior, "--beta", "0.05"]))
    straight = run(tmp_path / "a", cfg, device="cpu")
    run(tmp_path / "b", cfg, device="cpu", stop_after=4)
    assert run(tmp_path / "b", cfg, device="cpu") == straight
    log = [r for r in read_log(tmp_path / "a" / "log.jsonl") if r["split"] == "train"]
    assert ("distill" in log[0]) == (posterior == "exact+distill") and all(math.isfinite(r["loss"]) for r in log)
    loaded = load_run(tmp_path / "a")
    assert loaded.config.cvae.posterior == posterior


def test_the_celbo_scaled_control_trains_the_same_model_as_dist(tmp_path):
    "R_dist at beta is the cELBO at beta * c_theta up to a constant factor, which Adam ignores (no clipping here)."
    common = [*TINY, "--beta", "0.1", "--posterior", "exact", "--grad-clip", "1e6"]
    run(tmp_path / "dist", config_from_args(build_parser().parse_args([*common, "--objective", "dist"])), device="cpu")
    run(tmp_path / "ctrl", config_from_args(build_parser().parse_args([*common, "--objective", "celbo_scaled"])), device="cpu")
    # compare what the models compute, not raw weights: a key bias has zero gradient in exact arithmetic, and Adam
    # normalizes its round-off noise into steps whose sign differs between the two runs without changing any output
    la, lb = (read_log(tmp_path / d / "log.jsonl") for d in ("dist", "ctrl"))
    for ra, rb in zip(la, lb):
        for k in ("std", "kl", "theta"):
            assert ra[k] == pytest.approx(rb[k], rel=1e-3, abs=1e-6), (ra["step"], k)
    betas = [r["beta"] for r in read_log(tmp_path / "ctrl" / "log.jsonl") if r["split"] == "train"]
    assert betas[0] == pytest.approx(0.1 * load_run(tmp_path / "ctrl").c_ref)


def test_break_even_beta_on_a_hand_computed_profile():
    "Early regime, no ties, three strategies: Delta = log 3 on the first token; cELBO's beta* = E[1/T_y]."
    task = VisitingOrder.early()
    examples = [e for e in task.generate(300, seed=0) if len({e.x[0], e.x[1], e.x[-1]}) == 3]

    class Flat:  # a base whose surprisal is 1 on every response token
        def lookup(self, idx):
            T = max(len(examples[i].y) + 1 for i in idx)
            mask = torch.tensor([[t < len(examples[i].y) + 1 for t in range(T)] for i in idx])
            return mask.float(), mask

    d = break_even_beta(task, examples, Flat(), 0.5, ReconstructionLossConfig.celbo())
    inv_T = sum(1 / (len(e.y) + 1) for e in examples) / len(examples)
    assert d["beta_star"] == pytest.approx(inv_T, rel=1e-6) and d["strategy_nats"] == pytest.approx(math.log(3), rel=1e-6)
    assert break_even_beta(task, examples, Flat(), 0.5, ReconstructionLossConfig.dist())["beta_star"] == pytest.approx(inv_T / 0.5, rel=1e-6)


@pytest.mark.parametrize("counts, expected", [
    ([[10, 0, 0], [0, 10, 0], [0, 0, 10]], 1.0),
    ([[0, 10, 0], [0, 0, 10], [10, 0, 0]], 1.0),
    ([[1, 1, 1], [1, 1, 1], [1, 1, 1]], 1 / 3),
    ([[5, 0], [5, 0], [0, 10]], 0.75),                   # K > S
    ([[6, 2, 2]], 0.6),                                  # K < S
    ([[0, 0], [0, 0]], 0.0),
])
def test_alignment_one_to_one_on_hand_made_counts(counts, expected):
    assert alignment_one_to_one(torch.tensor(counts, dtype=torch.float64)) == pytest.approx(expected)
