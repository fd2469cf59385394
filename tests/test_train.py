"""Training: resume equivalence, frozen reference, cached vs recomputed b, enumeration, alignment, CLI validation."""
import json
import subprocess
import sys

import pytest
import torch

from basedirected.cvae import CVAEConfig, DiscreteCVAE, build_cvae
from basedirected.data import TraceConfig, Vocab, make_splits
from basedirected.model import (BaseTrainConfig, FrozenReference, ModelConfig, SurprisalCache, batch_indices, collate, gather_response,
                                pretrain_base, response_nll)
from basedirected.train import BetaSchedule, RunConfig, TrainConfig, build_parser, config_from_args, free_bits_kl, run, train_cvae

SMALL_MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)


def tiny_config(latent="discrete", steps=8, **train_kw):
    return RunConfig(n_train=600, n_eval=32, c_samples=64,
                     base=BaseTrainConfig(model=SMALL_MODEL, steps=40, batch_size=32),
                     cvae=CVAEConfig(latent=latent, K=3, latent_dim=3),
                     train=TrainConfig(steps=steps, batch_size=8, eval_every=4, checkpoint_every=4, **train_kw))


@pytest.fixture(scope="module")
def small_setup():
    vocab, cfg = Vocab(), TraceConfig.early(noise_tokens=1)
    train, held_out = make_splits(cfg, 600, 32, seed=0)
    base, _ = pretrain_base(vocab, train, BaseTrainConfig(model=SMALL_MODEL, steps=40, batch_size=32), seed=0)
    return vocab, train, held_out, base


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_resume_gives_the_same_final_metrics_as_an_uninterrupted_run(tmp_path, latent):
    cfg = tiny_config(latent)
    straight = run(tmp_path / "straight", cfg, device="cpu")
    run(tmp_path / "resumed", cfg, device="cpu", stop_after=4)  # "interrupted" after the step-4 checkpoint
    assert not (tmp_path / "resumed" / "eval.json").exists()
    resumed = run(tmp_path / "resumed", cfg, device="cpu")
    assert resumed == straight
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    log_a = [json.loads(l) for l in open(tmp_path / "straight" / "log.jsonl")]
    log_b = [json.loads(l) for l in open(tmp_path / "resumed" / "log.jsonl")]
    strip = lambda log: [{k: v for k, v in l.items() if k != "examples_per_s"} for l in log]
    assert strip(log_a) == strip(log_b)


def test_resume_after_lines_written_past_the_checkpoint_drops_them(tmp_path):
    cfg = tiny_config(steps=8)
    run(tmp_path, cfg, device="cpu", stop_after=4)
    with open(tmp_path / "log.jsonl", "a") as f:  # a crash after step 5 was logged but before its checkpoint
        f.write(json.dumps({"step": 5, "split": "train", "loss": 123.0}) + "\n")
    run(tmp_path, cfg, device="cpu")
    steps = [json.loads(l)["step"] for l in open(tmp_path / "log.jsonl") if json.loads(l)["split"] == "train"]
    assert steps == list(range(1, 9))


def test_seeded_runs_reproduce_exactly(tmp_path):
    cfg = tiny_config(steps=4)
    assert run(tmp_path / "a", cfg, device="cpu") == run(tmp_path / "b", cfg, device="cpu")


def test_run_refuses_a_directory_holding_another_configuration(tmp_path):
    run(tmp_path, tiny_config(steps=2), device="cpu")
    with pytest.raises(ValueError, match="different configuration"):
        run(tmp_path, tiny_config(steps=3), device="cpu")


def test_reference_is_unchanged_by_training_and_never_shares_storage(small_setup, tmp_path):
    vocab, train, held_out, base = small_setup
    reference = FrozenReference(base)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    model = DiscreteCVAE(base, vocab, CVAEConfig(K=3))
    ref_ptrs = {p.data_ptr() for p in reference.parameters()}
    assert not ref_ptrs & {p.data_ptr() for p in model.parameters()}
    cfg = tiny_config(steps=6)
    cache_t, cache_e = SurprisalCache(reference, vocab, train), SurprisalCache(reference, vocab, held_out)
    train_cvae(tmp_path, model, reference, train, held_out, cache_t, cache_e, 1.0, cfg)
    moved = any(not torch.equal(p, q) for p, q in zip(model.generator.parameters(), base.parameters()))
    assert moved  # the CVAE did train...
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())  # ...the reference did not
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())


def test_cached_and_recomputed_reference_agree(small_setup, tmp_path):
    vocab, train, held_out, base = small_setup
    reference = FrozenReference(base)
    cache = SurprisalCache(reference, vocab, train)
    for step in range(3):
        idx = batch_indices(len(train), 16, 0, step)
        cached, m1 = cache.lookup(idx)
        fresh, m2 = reference.response_surprisal(collate(vocab, [train[i] for i in idx]))
        assert torch.equal(m1, m2)
        torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-6)
    # and whole training runs agree
    r1 = run(tmp_path / "cached", tiny_config(steps=4), device="cpu")
    r2 = run(tmp_path / "recomputed", tiny_config(steps=4, recompute_reference=True), device="cpu")
    for k in r1:
        assert r1[k] == pytest.approx(r2[k], rel=1e-4, abs=1e-6), k


def test_alignment_of_generator_and_reference_positions(small_setup):
    vocab, _, held_out, base = small_setup
    gen = collate(vocab, held_out, ["<z1>"] * len(held_out))
    ref = collate(vocab, held_out)
    tg, mg = gather_response(gen.ids[:, 1:], gen)
    tr, mr = gather_response(ref.ids[:, 1:], ref)
    assert torch.equal(mg, mr) and torch.equal(tg, tr)
    for i, e in enumerate(held_out):
        assert vocab.decode(tg[i, : len(e.y) + 1]) == list(e.y) + ["</y>"]


def test_inert_initialization_is_close_for_every_code(small_setup):
    vocab, _, held_out, base = small_setup
    model = DiscreteCVAE(base, vocab, CVAEConfig(K=4))
    b, mask = FrozenReference(base).response_surprisal(collate(vocab, held_out))
    null, _ = response_nll(base, collate(vocab, held_out, ["<znull>"] * len(held_out)))
    with torch.no_grad():
        out = model(held_out)
    # every code behaves like the neutral code (the noise is small)...
    assert (out.nll_per_code - null[:, None]).abs()[mask[:, None].expand_as(out.nll_per_code)].max() < 0.05
    # ...router and posterior start (near) uniform
    assert (out.q - 0.25).abs().max() == 0 and (out.r - 0.25).abs().max() < 0.02
    # and the measured gap to the reference is reported, not assumed: it must be finite and small on average
    assert (out.nll - b).abs()[mask].mean() < 0.5


def test_exact_enumeration_equals_loop_over_codes(small_setup):
    vocab, _, held_out, base = small_setup
    model = DiscreteCVAE(base, vocab, CVAEConfig(K=3), seed=1)
    with torch.no_grad():
        out = model(held_out)
        q = torch.softmax(model.posterior_logits(held_out), -1)
        loop = sum(q[:, k, None] * response_nll(model.generator, collate(vocab, held_out, [c] * len(held_out)))[0]
                   for k, c in enumerate(model.codes))
    torch.testing.assert_close(out.nll, loop, rtol=1e-5, atol=1e-5)


def test_continuous_cvae_is_exactly_inert_at_init(small_setup):
    vocab, _, held_out, base = small_setup
    model = build_cvae(base, vocab, CVAEConfig(latent="continuous", latent_dim=3))
    null, _ = response_nll(base, collate(vocab, held_out, ["<znull>"] * len(held_out)))
    with torch.no_grad():
        out = model(held_out, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.nll, null, rtol=1e-5, atol=1e-5)
    assert out.kl.abs().max() == 0


def test_beta_schedules_and_free_bits():
    assert BetaSchedule("linear", 2.0, warmup_steps=10)(5) == 1.0
    assert BetaSchedule("cyclical", 1.0, period=10, ramp_fraction=0.5)(12) == pytest.approx(0.4)
    kl = torch.tensor([0.0, 0.2])
    from basedirected.cvae import CVAEOutput
    out = CVAEOutput(torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool), kl, None)
    assert free_bits_kl(out, 0.5).item() == 0.5 and free_bits_kl(out, 0.0).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match="needs a continuous latent"):
        free_bits_kl(out, 0.5, "dimension")


@pytest.mark.parametrize("argv, message", [
    (["--alpha", "2"], r"--alpha must lie in \[0, 1\]"),
    (["--gamma", "-1"], "--gamma must be >= 0"),
    (["--token-weighted-reconstruction-alpha", "nan"], "--gamma must be finite"),
    (["--beta", "-0.5"], "--beta must be >= 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--K", "0"], "--K must be >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lambda-tok", "-1"], "--lambda-tok must be >= 0"),
    (["--free-bits-mode", "dimension"], "--free-bits-mode dimension needs --latent continuous"),
    (["--tie-fraction", "1.5"], r"--tie-fraction must lie in \[0, 1\]"),
])
def test_option_validation_names_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(build_parser().parse_args(argv))


def test_cli_exits_2_with_one_line_before_any_work(tmp_path):
    run_dir = tmp_path / "never"
    p = subprocess.run([sys.executable, "-c", "from basedirected.train import train_main; train_main()",
                        "--alpha", "3", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].endswith("--alpha must lie in [0, 1], got 3.0")
    assert not run_dir.exists()


def test_original_flag_aliases_map_to_paper_fields():
    a = build_parser().parse_args(["--objective", "celbo", "--normalize-reconstruction-loss",
                                   "--token-weighted-reconstruction-weight", "0.3", "--token-weighted-reconstruction-alpha", "2",
                                   "--normalized-concentration-corrected-token-weighted-reconstruction-weight", "0.4",
                                   "--example-inverse-surprisal-reconstruction-weight", "0.1",
                                   "--ablation-inv-surp-token-weight", "0.2"])
    loss = config_from_args(a).loss
    assert (loss.lambda_std, loss.lambda_dist, loss.lambda_tok, loss.gamma, loss.lambda_tok_cc, loss.lambda_ex, loss.lambda_inv_tok) == \
        (0.0, 1.0, 0.3, 2.0, 0.4, 0.1, 0.2)


def test_help_documents_options_in_paper_terms():
    text = build_parser().format_help()
    for phrase in ("alpha in [0,1]", "concentration exponent", "--token-weighted-reconstruction-alpha", "KL weight beta"):
        assert phrase in text
