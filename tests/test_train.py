"""Training: resume equivalence, frozen reference, cached vs recomputed b, enumeration, alignment, the CVAE's KL and gradients,
CLI validation and the CLI / preset / sweep agreement."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from basedirected.base import BaseTrainConfig, FrozenReference, SurprisalCache, pretrain_base
from basedirected.cvae import CVAEConfig, DiscreteCVAE, build_cvae, router_logits
from basedirected.distributions import categorical_kl
from basedirected.model import ModelConfig, collate, gather_response, response_nll
from basedirected.objective import OBJECTIVE_NAMES, BetaSchedule, ReconstructionLossConfig, free_bits_kl, objective
from basedirected.runs import prepare_run, read_log
from basedirected.config import HFRunConfig, RunConfig, TrainConfig
from basedirected.tasks import Vocab, batch_indices, make_splits
from basedirected.cli import train_main
from basedirected.config import OPTIONS, build_parser, config_from_args
from basedirected.train import fit, run, train_run, train_step
from basedirected.visiting_order import VisitingOrder

SMALL_MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)


def tiny_config(latent="discrete", steps=8, **train_kw):
    return RunConfig(n_train=600, n_eval=32, c_samples=64,
                     base=BaseTrainConfig(model=SMALL_MODEL, steps=40, batch_size=32),
                     cvae=CVAEConfig(latent=latent, K=3, latent_dim=3),
                     train=TrainConfig(steps=steps, batch_size=8, eval_every=4, checkpoint_every=4, **train_kw))


@pytest.fixture(scope="module")
def small_setup():
    task = VisitingOrder.early(noise_tokens=1)
    vocab = Vocab.for_task(task)
    train, held_out = make_splits(task, 600, 32, seed=0)
    base, _ = pretrain_base(vocab, train, BaseTrainConfig(model=SMALL_MODEL, steps=40, batch_size=32), seed=0)
    return vocab, train, held_out, base


def _skewed(base, vocab, seed=3):
    "A discrete CVAE made non-inert by hand: spread-out codes and a random posterior head."
    model = DiscreteCVAE(base, vocab, CVAEConfig(K=3, code_init_noise=2.0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.posterior_head.weight.copy_(torch.randn(model.posterior_head.weight.shape, generator=g))
        model.posterior_head.bias.copy_(torch.randn(model.posterior_head.bias.shape, generator=g))
    return model


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
    strip = lambda log: [{k: v for k, v in l.items() if k != "examples_per_s"} for l in log]
    assert strip(read_log(tmp_path / "straight" / "log.jsonl")) == strip(read_log(tmp_path / "resumed" / "log.jsonl"))


def test_resume_after_lines_written_past_the_checkpoint_drops_them(tmp_path):
    cfg = tiny_config(steps=8)
    run(tmp_path, cfg, device="cpu", stop_after=4)
    with open(tmp_path / "log.jsonl", "a") as f:  # a crash after step 5 was logged but before its checkpoint, mid-line
        f.write(json.dumps({"step": 5, "split": "train", "loss": 123.0}) + "\n" + '{"step": 6, "spl')
    run(tmp_path, cfg, device="cpu")
    steps = [l["step"] for l in read_log(tmp_path / "log.jsonl") if l["split"] == "train"]
    assert steps == list(range(1, 9))


def test_seeded_runs_reproduce_exactly(tmp_path):
    cfg = tiny_config(steps=4)
    assert run(tmp_path / "a", cfg, device="cpu") == run(tmp_path / "b", cfg, device="cpu")


def test_run_refuses_a_directory_holding_another_configuration(tmp_path):
    run(tmp_path, tiny_config(steps=2), device="cpu")
    with pytest.raises(ValueError, match="different configuration"):
        run(tmp_path, tiny_config(steps=3), device="cpu")


def test_reference_is_unchanged_by_training_and_never_shares_storage(tmp_path):
    r = prepare_run(tmp_path, tiny_config(steps=6), device="cpu")
    before = {k: v.clone() for k, v in r.reference.state_dict().items()}
    assert not {p.data_ptr() for p in r.reference.parameters()} & {p.data_ptr() for p in r.model.parameters()}
    train_run(r)
    assert any(not torch.equal(p, q) for p, q in zip(r.model.generator.parameters(), r.base.parameters()))  # the CVAE trained...
    assert all(torch.equal(before[k], v) for k, v in r.reference.state_dict().items())  # ...the reference did not
    assert not r.reference.training and not any(p.requires_grad for p in r.reference.parameters())


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
    assert (out.nll_per_code - null[:, None]).abs()[mask[:, None].expand_as(out.nll_per_code)].max() < 0.05
    assert (out.q - 0.25).abs().max() == 0 and (out.r - 0.25).abs().max() < 0.02
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


def test_the_cvae_rate_is_kl_of_posterior_to_router_on_a_non_inert_model(small_setup):
    vocab, _, held_out, base = small_setup
    model = _skewed(base, vocab)
    with torch.no_grad():
        out = model(held_out)
        q_logits, r_logits = model.posterior_logits(held_out), router_logits(model, held_out)
    q, r = q_logits.softmax(-1).double(), r_logits.softmax(-1).double()
    loop = (q * (q.log() - r.log())).sum(-1)  # KL(q || r) written out
    torch.testing.assert_close(out.kl.double(), loop, rtol=1e-4, atol=1e-5)
    assert (out.kl - categorical_kl(r_logits, q_logits)).abs().max() > 1e-2  # KL(r || q) differs here: the direction is tested


def test_the_reconstruction_alone_sends_gradient_to_the_posterior(small_setup):
    vocab, _, held_out, base = small_setup
    model = _skewed(base, vocab)
    out = model(held_out[:16])
    b, mask = FrozenReference(base).response_surprisal(collate(vocab, held_out[:16]))
    terms = objective(out.nll, b, mask, 1.0, out.kl, 0.0, ReconstructionLossConfig.theta())  # beta = 0: no KL in the loss
    terms["loss"].backward()
    assert model.posterior_head.weight.grad.abs().sum() > 0
    assert sum(p.grad.abs().sum() for p in model.posterior.parameters() if p.grad is not None) > 0  # through q into the posterior backbone


def test_continuous_cvae_is_exactly_inert_at_init(small_setup):
    vocab, _, held_out, base = small_setup
    model = build_cvae(base, vocab, CVAEConfig(latent="continuous", latent_dim=3))
    null, _ = response_nll(base, collate(vocab, held_out, ["<znull>"] * len(held_out)))
    with torch.no_grad():
        out = model(held_out, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.nll, null, rtol=1e-5, atol=1e-5)
    assert out.kl.abs().max() == 0


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_cvae_forward_and_backward_under_bf16_autocast(small_setup, latent):
    "The GPU recipe's dtype path (bf16 autocast around the CVAE, float32 objective), checked on the CPU's autocast."
    vocab, _, held_out, base = small_setup
    model = build_cvae(base, vocab, CVAEConfig(latent=latent, K=3, latent_dim=3))
    with torch.no_grad():
        ref = model(held_out[:8], torch.Generator().manual_seed(0)) if latent == "continuous" else model(held_out[:8])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(held_out[:8], torch.Generator().manual_seed(0)) if latent == "continuous" else model(held_out[:8])
    assert out.kl.dtype == torch.float32
    b, mask = FrozenReference(base).response_surprisal(collate(vocab, held_out[:8]))
    terms = objective(out.nll.float(), b, mask, 1.0, out.kl, 0.1, ReconstructionLossConfig.theta())
    terms["loss"].backward()
    assert torch.isfinite(terms["loss"]) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.testing.assert_close(out.nll.float(), ref.nll, rtol=0.05, atol=0.05)  # bf16 tolerance


def test_beta_schedules_and_free_bits():
    assert BetaSchedule("linear", 2.0, warmup_steps=10)(5) == 1.0
    assert BetaSchedule("cyclical", 1.0, period=10, ramp_fraction=0.5)(12) == pytest.approx(0.4)
    kl = torch.tensor([0.0, 0.2])
    assert free_bits_kl(kl, None, 0.5).item() == 0.5 and free_bits_kl(kl, None, 0.0).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match="needs a continuous latent"):
        free_bits_kl(kl, None, 0.5, "dimension")


@pytest.mark.parametrize("argv, message", [
    (["--alpha", "2"], r"--alpha must lie in \[0, 1\]"),
    (["--gamma", "-1"], "--gamma must be >= 0"),
    (["--beta", "-0.5"], "--beta must be >= 0"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--base-steps", "0"], "--base-steps must be >= 1"),
    (["--K", "0"], "--K must be an integer >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lambda-tok", "-1"], "--lambda-tok must be >= 0"),
    (["--free-bits-mode", "dimension"], "--free-bits-mode 'dimension' needs --latent 'continuous'"),
    (["--tie-fraction", "1.5"], r"--tie-fraction must lie in \[0, 1\]"),
    (["--n-train", "1"], "--n-train must be >= 2"),
])
def test_option_validation_names_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv, message", [(["--token-weighted-reconstruction-alpha", "nan"], "--token-weighted-reconstruction-alpha must be finite, got nan"),
                                           (["--seed", str(2**70)], "--seed must be <= 2,147,483,647")])
def test_a_value_beyond_its_rows_ceiling_stops_the_parser_naming_the_spelling_given(argv, message, capsys):
    with pytest.raises(SystemExit) as e: build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err

def test_cli_exits_2_with_one_line_before_any_work(tmp_path):
    run_dir = tmp_path / "never"
    p = subprocess.run([sys.executable, "-c", "from basedirected.cli import train_main; train_main()",
                        "--alpha", "3", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].endswith("--alpha must lie in [0, 1], got 3.0")
    assert not run_dir.exists()


MY_TASKS = """
from dataclasses import dataclass
from basedirected.sorting import Sorting

@dataclass(frozen=True)
class ShortSorting(Sorting):
    "Sorting of three-digit lists: a task of one's own, with its own base recipe."
    name = "short_sorting"
    base_recipe = {"steps": 30, "d_model": 32, "n_layers": 1}
    min_digits: int = 3
    max_digits: int = 3
"""


def test_a_task_of_your_own_runs_from_the_cli_as_module_and_class(tmp_path):
    "`--task module:Class` imports the module from the working directory, and its class's base_recipe sizes the base."
    (tmp_path / "my_tasks.py").write_text(MY_TASKS)
    run_dir = tmp_path / "run"
    argv = ["--task", "my_tasks:ShortSorting", "--run-dir", str(run_dir), "--n-train", "300", "--n-eval", "16", "--n-heads", "2",
            "--c-samples", "32", "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--checkpoint-every", "2", "--K", "3",
            "--n-routed", "8", "--n-forced", "4", "--allow-failed-base", "--quiet"]
    p = subprocess.run([sys.executable, "-c", "from basedirected.cli import train_main; train_main()", *argv],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["task"]["name"] == "short_sorting" and config["task"]["max_digits"] == 3
    assert (config["base"]["steps"], config["base"]["model"]["d_model"], config["base"]["model"]["n_layers"]) == (30, 32, 1)
    assert (run_dir / "eval.json").exists()


@pytest.mark.parametrize("task, message", [
    ("nope", "unknown task 'nope': one of addition, grid_pathfinding, sorting, visiting_order, or module:Class"),
    ("no_such_module_here:Task", "cannot import 'no_such_module_here'"),
    ("basedirected.tasks:Example", "has no Task subclass 'Example'"),
    ("basedirected.tasks:Task", "sets no `name`"),
])
def test_an_unknown_task_is_refused_with_what_is_wrong(task, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--task", task, "--run-dir", "never"])
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--device", "foo"], "device must be 'auto', 'cpu' or 'cuda[:i]', got 'foo'"),
    (["--gamma", "2", "--token-weighted-reconstruction-alpha", "1"], "set the same option; give only one"),
])
def test_cli_refuses_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_force_deletes_only_what_the_package_wrote_and_only_in_a_run_directory(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        train_main(["--run-dir", str(tmp_path), "--force"])
    assert e.value.code == 2 and "is not a run directory" in capsys.readouterr().err and (tmp_path / "precious.txt").exists()


def test_original_flag_aliases_map_to_paper_fields():
    a = build_parser().parse_args(["--objective", "celbo", "--normalize-reconstruction-loss",
                                   "--token-weighted-reconstruction-weight", "0.3", "--token-weighted-reconstruction-alpha", "2",
                                   "--normalized-concentration-corrected-token-weighted-reconstruction-weight", "0.4",
                                   "--example-inverse-surprisal-reconstruction-weight", "0.1",
                                   "--ablation-inv-surp-token-weight", "0.2"])
    loss = config_from_args(a).loss
    assert (loss.lambda_std, loss.lambda_dist, loss.lambda_tok, loss.gamma, loss.lambda_tok_cc, loss.lambda_ex, loss.lambda_inv_tok) == \
        (0.0, 1.0, 0.3, 2.0, 0.4, 0.1, 0.2)


def test_objective_keeps_its_alpha_unless_given():
    c = config_from_args(build_parser().parse_args(["--objective", "tok_cc"]))
    assert c.loss.alpha == 0.0 and c.objective == "tok_cc"  # the logged theta term is the preset's, not the CLI default's
    c = config_from_args(build_parser().parse_args(["--objective", "theta", "--alpha", "0.2"]))
    assert (c.loss.alpha, c.loss.lambda_dist, c.loss.lambda_tok_cc) == (0.2, 0.2, 0.8)


def test_help_documents_options_in_paper_terms():
    text = " ".join(build_parser().format_help().split())
    for phrase in ("alpha in [0, 1]", "concentration exponent", "--token-weighted-reconstruction-alpha", "KL weight beta", "--backbone BACKBONE",
                   "--data DATA", "--adapt {frozen,lora,full}", "--optimizer {adamw,muon}", "--stop-after STOP_AFTER"):
        assert phrase in text, phrase


def test_cli_is_generated_from_the_run_configuration():
    choices = next(o for o in OPTIONS if o.flag == "--objective").choices
    assert tuple(choices) == OBJECTIVE_NAMES
    from basedirected.config import resolve_config
    assert config_from_args(build_parser().parse_args([])) == resolve_config()  # the default run, as the API resolves it
    from basedirected.config import field_comments, option_help
    for o in OPTIONS:  # every option names a real field; its help is the field's comment and shows the configuration's default
        if not o.path or o.help is not None: continue
        *head, name = o.path.split(".")
        config = RunConfig() if "tiny" in o.backbones else HFRunConfig("", "")
        owner = eval("config." + ".".join(head)) if head else config
        assert option_help(o).startswith(field_comments(type(owner))[name]), o.flag
        if o.default is ...: assert f"(default: {eval('config.' + o.path)}" in option_help(o), o.flag
        assert build_parser().get_default(o.dest) in (None, False), o.flag  # a field stays unset unless given


# --- tau, the base seed and the thread count ---

def test_a_run_at_tau_trains_at_tau_times_its_break_even(tmp_path):
    from basedirected.metrics import break_even_beta
    cfg = tiny_config(tau=0.5)
    final = run(tmp_path / "t", cfg, device="cpu", metrics=True)
    r = prepare_run(tmp_path / "t", cfg, "cpu")
    beta_star = break_even_beta(r.task, r.held_out, r.eval_cache, r.c_ref, cfg.loss)["beta_star"]
    assert r.kl_weight(0) == pytest.approx(0.5 * beta_star, rel=1e-12)
    logged = [l["beta"] for l in read_log(tmp_path / "t" / "log.jsonl") if l["split"] == "train"]
    assert logged and all(b == pytest.approx(0.5 * beta_star) for b in logged)
    m = json.loads((tmp_path / "t" / "metrics.json").read_text())
    assert m["tau_target"] == 0.5 and m["tau_effective"] == pytest.approx(0.5) and m["beta_effective"] == pytest.approx(0.5 * beta_star)
    import basedirected
    from pathlib import Path
    from basedirected.machine import cpu_model
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=str(Path(basedirected.__file__).parent)).stdout.strip() or None
    assert m["git_revision"] == head and isinstance(m["git_dirty"], bool) and m["cpu"] == cpu_model()  # the record says what completed it
    assert 0 < m["revealing_share"] <= 1  # the share of the base's held-out surprisal on strategy-revealing tokens (notebook 05)
    assert "settled_strict" in m and not (m["settled_strict"] and not m["settled"])  # the generator's rule is the stricter one (notebook 08)
    assert final["kl"] >= 0


def test_celbo_scaled_at_tau_is_the_celbo_at_tau():
    "On the tau axis the cELBO(beta c) control is the cELBO itself: the same loss at the same effective KL weight."
    c = config_from_args(build_parser().parse_args(["--objective", "celbo_scaled", "--tau", "0.2"]))
    e = config_from_args(build_parser().parse_args(["--objective", "celbo", "--tau", "0.2"]))
    assert c.loss == e.loss and c.train.beta_times_c_ref and not e.train.beta_times_c_ref
    assert c.train.kl_weight(5, c_ref=0.04, beta_star=0.03) == e.train.kl_weight(5, c_ref=0.04, beta_star=0.03) == pytest.approx(0.006)


def test_tau_and_beta_together_are_refused():
    with pytest.raises(ValueError, match="--tau and --beta both set the KL weight"):
        config_from_args(build_parser().parse_args(["--tau", "0.1", "--beta", "0.3"]))


def test_cvae_seeds_sharing_a_base_seed_share_the_base_and_data_but_not_the_cvae(tmp_path):
    a = run(tmp_path / "a", tiny_config(), device="cpu")
    cfg_b = RunConfig(**{**tiny_config().__dict__, "seed": 7, "base_seed": 0})
    b = run(tmp_path / "b", cfg_b, device="cpu")
    base_a = torch.load(tmp_path / "a" / "base.pt", weights_only=True)["model"]
    base_b = torch.load(tmp_path / "b" / "base.pt", weights_only=True)["model"]
    assert all(torch.equal(base_a[k], base_b[k]) for k in base_a)  # one base: seed 0's
    assert json.loads((tmp_path / "a" / "reference_scale.json").read_text())["model"] == json.loads((tmp_path / "b" / "reference_scale.json").read_text())["model"]
    assert a["base_mean"] == b["base_mean"]                         # the same held-out split
    assert a["loss"] != b["loss"]                                   # another CVAE


def test_the_thread_count_is_part_of_the_run_and_applied(tmp_path):
    before = torch.get_num_threads()
    try:
        cfg = RunConfig(**{**tiny_config(steps=2).__dict__, "threads": 1})
        prepare_run(tmp_path / "r", cfg, "cpu")
        assert torch.get_num_threads() == 1
        assert json.loads((tmp_path / "r" / "config.json").read_text())["config"]["threads"] == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_grad_accum_micro_batches_take_the_whole_batchs_step(tmp_path, latent):
    cfg = tiny_config(latent, grad_clip=1e6, recompute_reference=latent == "discrete")  # clipping off; both sources of b_t
    r = prepare_run(tmp_path / "run", cfg, device="cpu")
    r.model.train()
    start = {k: v.clone() for k, v in r.model.state_dict().items()}
    steps = {}
    for n in (1, 2, 4):
        r.model.load_state_dict(start)
        r.config = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=n))
        sgd = torch.optim.SGD([p for p in r.model.parameters() if p.requires_grad], lr=1.0)  # plain SGD moves by the gradient, its scale included
        record = train_step(r, [sgd], 3, 0.5, 0.05)
        steps[n] = {k: v for k, v in record.items() if isinstance(v, float) and k != "examples_per_s"}, {k: v.clone() for k, v in r.model.state_dict().items()}
    assert steps[1][0].keys() == steps[2][0].keys() and "kappa_max" in steps[1][0]
    for n in (2, 4):  # the record is the whole batch's, and so is the step
        torch.testing.assert_close(steps[n][0], steps[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(steps[n][1], steps[1][1], rtol=1e-5, atol=1e-6)
    assert max((steps[1][1][k] - start[k]).abs().max() for k in start) > 1e-3  # the step moved the weights: equal weights say something


def test_grad_accum_is_refused_where_it_cannot_split_the_batch(tmp_path, capsys):
    from basedirected.groups import RunGroup
    cfg = tiny_config(steps=2, grad_accum=2)
    r = prepare_run(tmp_path / "run", cfg, device="cpu")
    with pytest.raises(ValueError, match="grad_accum 2: RunGroup steps the whole batch at once"): fit([r], stepper=RunGroup)
    assert not (tmp_path / "run" / "log.jsonl").exists() or not read_log(tmp_path / "run" / "log.jsonl")
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", str(tmp_path / "cli"), "--batch-size", "8", "--grad-accum", "3", "--quiet"])
    assert e.value.code == 2 and "--batch-size 8 must be divisible by --grad-accum 3" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


def test_tensorboard_events_are_the_logs_records_and_change_nothing(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    argv = lambda rd, *extra: ["--run-dir", str(rd), "--n-train", "600", "--n-eval", "32", "--c-samples", "64", "--base-steps", "40", "--d-model", "32",
                               "--n-layers", "1", "--steps", "6", "--batch-size", "8", "--eval-every", "3", "--quiet", "--no-metrics", "--allow-failed-base", *extra]
    assert train_main(argv(tmp_path / "plain")) == 0
    assert train_main(argv(tmp_path / "seen", "--tensorboard", str(tmp_path / "tb"))) == 0
    drop = lambda log: [{k: v for k, v in r.items() if k != "examples_per_s"} for r in log]
    assert drop(read_log(tmp_path / "seen" / "log.jsonl")) == drop(read_log(tmp_path / "plain" / "log.jsonl"))  # the log and the run are unchanged
    assert train_main(argv(tmp_path / "other", "--tensorboard", str(tmp_path / "tb"), "--seed", "1")) == 0  # a second run in the same DIR
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["other", "seen"]  # each run's events in DIR/<its run directory's name>
    events = EventAccumulator(str(tmp_path / "tb" / "seen")); events.Reload()
    log = read_log(tmp_path / "seen" / "log.jsonl")
    for split, term in (("train", "loss"), ("train", "kl"), ("train", "grad_norm"), ("eval", "loss")):
        got = [(e.step, e.value) for e in events.Scalars(f"{split}/{term}")]
        want = [(r["step"], r[term]) for r in log if r["split"] == split]
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want], dtype=torch.float32))  # events hold float32
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: train_main(argv(tmp_path / "without", "--tensorboard", str(tmp_path / "tb2")))
    assert e.value.code == 2 and "--tensorboard needs the tensorboard package: pip install tensorboard" in capsys.readouterr().err
    assert not (tmp_path / "without").exists()
