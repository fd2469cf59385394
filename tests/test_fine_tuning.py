"""A base fine-tuned from a backbone on the task's own data: the command, the gate's refusal, a kill in every phase, --force, and a tokenizer that cannot write the task."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from basedirected.cli import train_main
from basedirected.config import resolve_config
from basedirected.backbone import save_tiny_backbone, task_records
from basedirected.hf import hf_run
from basedirected.pretrained import file_sha256
from basedirected.runs import RunDir, read_json
from basedirected.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)  # tiny models: threads only contend
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    d = tmp_path_factory.mktemp("fine_tuning")
    task = make_task("sorting")
    save_tiny_backbone(d / "gpt2", [r.prompt + " " + r.response for r in task_records(task, task.generate(100, 0))], "gpt2")
    save_tiny_backbone(d / "letters", ["a b c d e f g h"], "gpt2")  # a tokenizer that has none of sorting's tokens
    return d


SMALL = ["--task", "sorting", "--n-train", "64", "--n-eval", "16", "--fine-tune-steps", "8", "--fine-tune-batch-size", "8", "--fine-tune-checkpoint-every", "2",
         "--K", "3", "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--c-samples", "16", "--n-routed", "8", "--n-forced", "8",
         "--device", "cpu", "--quiet"]


def _cmd(backbone, run, *extra):
    return ["--backbone", str(backbone / "gpt2"), "--run-dir", str(run), *SMALL, *extra]


def _base_files(run):
    rd = RunDir(run)
    return {f.name: file_sha256(f) for f in sorted(rd.fine_tuned.iterdir()) if f.name != "fine_tune.json"}


def test_the_command_fine_tunes_gates_and_refuses_a_failed_base(backbone, tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e: train_main(_cmd(backbone, run))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fails the quality gate" in err[0] and "--fine-tune-steps" in err[0], err
    rd = RunDir(run)
    assert not rd.checkpoint.exists() and not read_json(rd.gate)["passes"]  # refused before the CVAE trained
    assert rd.train_data.is_file() and rd.eval_data.is_file() and not rd.base_checkpoint.exists()
    record = read_json(rd.fine_tuned / "fine_tune.json")
    assert record["key"]["fine_tune"]["steps"] == 8 and len(record["losses"]) == 8
    assert train_main(_cmd(backbone, run, "--allow-failed-base")) == 0  # the same run, allowed: fine-tuning and gate are read back
    m = read_json(rd.metrics)
    assert m["eval_split"] == "eval_data" and "gen_alignment_controlled_all" in m and m["gen_n_forced_inputs"] == 8
    assert read_json(rd.config)["config"]["fine_tune"]["steps"] == 8


def test_the_api_resolves_the_same_run(backbone, tmp_path):
    cfg = resolve_config("sorting", backbone=str(backbone / "gpt2"), overrides={
        "n_train": 64, "n_eval": 16, "fine_tune.steps": 8, "fine_tune.batch_size": 8, "fine_tune.checkpoint_every": 2, "cvae.K": 3, "train.steps": 4,
        "train.batch_size": 8, "train.eval_every": 2, "c_samples": 16, "metrics.n_routed": 8, "metrics.n_forced": 8})
    hf_run(tmp_path / "api", cfg, device="cpu", require_gate=False)
    assert train_main(_cmd(backbone, tmp_path / "cli", "--allow-failed-base")) == 0
    api, cli = read_json(tmp_path / "api" / "config.json")["config"], read_json(tmp_path / "cli" / "config.json")["config"]
    assert api == cli
    assert _base_files(tmp_path / "api") == _base_files(tmp_path / "cli")  # the same base, byte for byte
    assert read_json(tmp_path / "api" / "metrics.json") == read_json(tmp_path / "cli" / "metrics.json")


def _kill_when(args, path, timeout=120):
    "Start the command, kill -9 it once `path` exists."
    p = subprocess.Popen([sys.executable, "-c", "import sys; from basedirected.cli import train_main; sys.exit(train_main(sys.argv[1:]))", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    while not path.exists() and p.poll() is None and time.time() - t0 < timeout: time.sleep(0.01)
    if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)
    p.wait()


KILLED = ["--allow-failed-base", "--fine-tune-steps", "24", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def whole(backbone, tmp_path_factory):
    "The run no kill interrupts."
    run = tmp_path_factory.mktemp("whole") / "run"
    assert train_main(_cmd(backbone, run, *KILLED)) == 0
    return run


@pytest.mark.parametrize("phase", ["base_checkpoint.pt", "fine_tuned_base", "base_gate.json", "checkpoint.pt"])
def test_a_kill_in_any_phase_resumes_to_the_same_files(backbone, whole, tmp_path, phase):
    "Killed once the phase's first file appears (fine-tuning, the saved base, the gate, the CVAE), the same command ends with the uninterrupted run's files."
    killed, extra = tmp_path / "killed", KILLED
    _kill_when(_cmd(backbone, killed, *extra), killed / phase)
    assert train_main(_cmd(backbone, killed, *extra)) == 0
    assert _base_files(killed) == _base_files(whole)
    for name in ("base_gate.json", "reference_scale.json", "eval.json", "metrics.json"):
        assert read_json(killed / name) == read_json(whole / name), name


def test_force_clears_the_fine_tuned_base(backbone, tmp_path):
    run = tmp_path / "run"
    assert train_main(_cmd(backbone, run, "--allow-failed-base")) == 0
    before = RunDir(run).fine_tuned.stat().st_mtime_ns
    assert train_main(_cmd(backbone, run, "--allow-failed-base", "--force")) == 0
    assert RunDir(run).fine_tuned.stat().st_mtime_ns != before  # fine-tuned again, not read back


def test_a_tokenizer_that_cannot_write_the_task_is_refused_before_fine_tuning(backbone, tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e: train_main(["--backbone", str(backbone / "letters"), "--run-dir", str(run), *SMALL])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer cannot encode the data" in err[0], err
    assert not RunDir(run).fine_tuned.exists()


def test_options_of_the_fine_tuning_without_fine_tuning_are_refused(backbone, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    task = make_task("sorting")
    data.write_text("".join(json.dumps(r.__dict__) + "\n" for r in task_records(task, task.generate(16, 0))))
    with pytest.raises(SystemExit): train_main(["--backbone", str(backbone / "gpt2"), "--data", str(data), "--run-dir", str(tmp_path / "r"), "--fine-tune-lr", "0.01"])
    assert "--fine-tune-lr has no effect here" in capsys.readouterr().err


def test_the_plan_says_every_phase_first_and_only_what_is_left(backbone, whole, tmp_path, capsys):
    "A run on a backbone prints its plan before it works, as the small transformer's does; a finished run's plan has nothing left but what it reads."
    from basedirected.config import HFRunConfig
    from basedirected.hf import hf_run_plan
    from basedirected.train import plan_text
    config = HFRunConfig.from_dict(read_json(whole / "config.json")["config"])
    fresh = hf_run_plan(tmp_path / "new", config)
    assert [p["phase"] for p in fresh] == ["data", "fine_tune", "gate", "c_theta", "cvae", "metrics"]
    assert "24 of 24 steps of 8" in fresh[1]["what"] and "no time estimate" in plan_text(fresh) and "estimated" not in plan_text(fresh)
    done = hf_run_plan(whole, config)
    assert [(p["phase"], p["seconds"]) for p in done] == [("data", 0.0), ("fine_tune", 0.0), ("cvae", 0.0)] and "0 of 4 steps" in done[-1]["what"]
    assert "estimated 0 s" in plan_text(done)
    import shutil
    shutil.copytree(whole, tmp_path / "again")  # a rerun of a finished run prints its plan and trains nothing
    capsys.readouterr()
    assert train_main([a for a in _cmd(backbone, tmp_path / "again", *KILLED) if a != "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.index("fine_tune") < err.index("cvae") and "the fine-tuned base, in the run directory" in err and "estimated 0 s" in err


# what a run on a backbone does not record yet, and why: the break-even beta* and its parts need the task's ideal and oracle surprisal in
# the small transformer's token layout; I(z;s|x), the gain from z and the validity under each forced code are computed by its own metrics only
NOT_ON_A_BACKBONE = {"beta_star", "strategy_nats", "objective_gain", "reveal_weight", "revealing_share"}  # the break-even beta*'s: no tau on a backbone


def test_a_backbone_runs_record_names_the_small_transformers_so_the_reports_read_both(whole):
    "Every name of a small transformer's metrics.json is in a backbone run's too, with the same meaning, but those listed above (its own eval_split aside)."
    tiny = read_json(ROOT / "reference" / "own-task" / "metrics.json")
    m = read_json(RunDir(whole).metrics)
    assert set(tiny) - set(m) == NOT_ON_A_BACKBONE
    newer = {"base_b_mean", "base_b_cv", "base_b_top10_share"}  # recorded by every run since own-task's was made
    assert {k for k in set(m) - set(tiny) if not k.startswith("gen_forced_valid_rate_z3")} == {"eval_split"} | newer  # own-task has 2 codes, this run 3
    assert 0 <= m["I_zs_given_x_norm"] <= 1 + 1e-9 and m["T_y_min"] <= m["T_y_mean"] <= m["T_y_max"] and all(
        0 <= m[f"gen_forced_valid_rate_z{k}"] <= 1 for k in (1, 2, 3))
    rd = RunDir(whole)
    sums = read_json(rd.fine_tuned / "fine_tune.json")["sha256"]
    assert (m["task"], m["base_name"], m["base_seed"], m["tau_effective"]) == ("sorting", "gpt2 fine-tuned", 0, None) and [m["base_sha256"]] == list(sums.values())
    assert m["c_model"] == read_json(rd.scale)["model"]["value"] and m["gate_passes"] == float(read_json(rd.gate)["passes"])
    assert m["settled"] in (True, False) and m["eval_loss"] == read_json(rd.eval)["loss"]


def test_the_cvae_seeds_of_one_base_seed_share_its_fine_tuned_base(backbone, whole, tmp_path):
    "--base-seed seeds the task's examples, the fine-tuning, the gate and c_theta: another CVAE seed on base seed 0 fine-tunes the very base of `whole` (seed 0) and trains another CVAE."
    other = tmp_path / "other"
    assert train_main(_cmd(backbone, other, *KILLED, "--seed", "1", "--base-seed", "0")) == 0
    a, b = RunDir(whole), RunDir(other)
    assert _base_files(other) == _base_files(whole)
    assert all((a.path / f).read_bytes() == (b.path / f).read_bytes() for f in (a.train_data.name, a.eval_data.name, a.gate.name))
    # c_theta from the same samples of the same base, bit for bit: the reference is the generator with its adapters off, whose codes' rows
    # (drawn from the CVAE's seed) no response token's normalizer reads, a <z> this untrained base samples inside a response included
    assert read_json(a.scale) == read_json(b.scale)
    assert read_json(b.metrics)["base_seed"] == read_json(a.metrics)["base_seed"] == 0 and read_json(b.metrics)["seed"] == 1
    wa, wb = (torch.load(d.checkpoint, weights_only=True)["model"] for d in (a, b))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # the CVAE's seed is its own
