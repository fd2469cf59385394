"""What the command lines and the API refuse, in one line naming the option or file, before anything is written: the cases a
careful user and a hostile tester found silently accepted, unclear or late."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from basedirected.cli import train_main
from basedirected.config import build_parser, option_help, OPTIONS
from basedirected.cluster import ClusterConfig, preset_from_record
from basedirected.presets import PRESETS, plan
from basedirected.repro import repro_main
from basedirected.runs import RunDir, read_json
from basedirected.config import RunConfig
from basedirected.tasks import task_class

TINY = ["--task", "visiting_order", "--posterior", "amortized", "--n-train", "600", "--n-eval", "32", "--c-samples", "64", "--base-steps", "40", "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--d-ff", "64", "--K", "3", "--steps", "8", "--batch-size", "8", "--eval-every", "4", "--checkpoint-every", "4", "--quiet",
        "--allow-failed-base"]


def repro(*argv, capsys):
    "Exit status and stderr lines of `basedirected-repro` in-process."
    try: code = repro_main([*argv])
    except SystemExit as e: code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def train(*argv, capsys):
    try: code = train_main([*argv])
    except SystemExit as e: code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


# --- the API ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("seed", True), ("threads", True), ("seed", 1.0), ("base_seed", False)])
def test_run_config_refuses_a_bool_or_float_where_an_integer_goes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer"): RunConfig(**{field: value})


@pytest.mark.parametrize("kw, message", [
    (dict(timeout_min="5"), "--timeout-min must be an integer, got '5'"),
    (dict(cpus_per_job=1.5), "--cpus-per-job must be an integer, got 1.5"),
    (dict(gpus_per_job=True), "--gpus-per-job must be an integer, got True"),
    (dict(mem_gb=float("inf")), "--mem-gb must be a finite number > 0, got inf"),
    (dict(mem_gb=float("nan")), "--mem-gb must be a finite number > 0, got nan"),
    (dict(poll_s="1"), "--poll-s must be a number, got '1'"),
])
def test_cluster_config_refuses_wrong_types_by_name(kw, message):
    with pytest.raises(ValueError) as e: ClusterConfig(executor="submitit", **kw)
    assert message in str(e.value)


def test_task_class_of_something_that_is_not_a_name_says_so():
    with pytest.raises(TypeError, match="a task is named by a string"): task_class(None)
    with pytest.raises(ValueError, match="needs both a module and a class name"): task_class(":VisitingOrder")
    with pytest.raises(ValueError, match="needs both a module and a class name"): task_class("basedirected.visiting_order:")


def test_metrics_refuse_what_is_not_a_distribution_or_a_label():
    from basedirected.metrics import entropy, information_gain, strategy_information
    with pytest.raises(ValueError, match="entropy needs probabilities"): entropy(torch.tensor([1.5, -0.5]))
    with pytest.raises(ValueError, match="entropy needs probabilities"): entropy(torch.tensor([float("nan"), 1.0]))
    assert entropy(torch.tensor([0.5, 0.5, -1e-9])).item() == pytest.approx(0.6931, abs=1e-4)  # round-off below zero is no error
    with pytest.raises(ValueError, match=r"strategies must be >= 0 \(known\) or -1 \(unknown\), got -2"):
        strategy_information(torch.full((2, 2), 0.5), torch.tensor([0, -2]))
    with pytest.raises(ValueError, match=r"must be \(N,\) tensors of one length"): information_gain(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match=r"must be \(N,\) tensors of one length"): information_gain(torch.ones(2, 2), torch.ones(2, 2))
    assert information_gain(torch.tensor([0.5]), torch.tensor([1.0])) == {"gain_abs": 0.5, "gain_frac": 0.5}


# --- basedirected-train -----------------------------------------------------------------------------------------------------------

def test_every_options_help_renders():
    "A '%' in a field's comment is argparse's format character: every option's help is rendered, none shows argparse's internals."
    text = build_parser().format_help()
    assert "option_strings" not in text and "top-k% surprisal" in text
    actions = build_parser()._option_string_actions
    for o in OPTIONS: assert actions[o.flag].help % {} == option_help(o)  # argparse's own formatting step gives the text back unchanged


def test_tie_fraction_applies_to_the_tasks_that_have_ties_only(tmp_path, capsys):
    from basedirected.config import config_from_args
    p = build_parser()
    assert config_from_args(p.parse_args(["--task", "sorting", "--tie-fraction", "0.5"])).task.tie_fraction == 0.5  # sorting's own ties
    assert config_from_args(p.parse_args(["--tie-fraction", "0.5"])).task.tie_fraction == 0.5  # visiting_order's palindromes
    code, err = train("--run-dir", str(tmp_path / "r"), "--task", "addition", "--tie-fraction", "0.5", capsys=capsys)  # refused before the base trains
    assert code == 2 and "--tie-fraction does not apply to task addition" in err[-1] and not (tmp_path / "r").exists()
    shown = " ".join(p.format_help().split())
    for task in ("visiting_order: fraction of palindromic inputs", "sorting: fraction of inputs on which two or more algorithms write the same trace",
                 "grid_pathfinding: fraction of inputs with start and goal on one line"): assert task in shown


# --- basedirected-repro -----------------------------------------------------------------------------------------------------------

def test_repro_refuses_an_empty_out(capsys):
    code, err = repro("--preset", "smoke", "--out", "", "--quiet", capsys=capsys)
    assert code == 2 and "--out must name a directory, got an empty string" in err[-1]
    assert not Path("runs/repro-smoke").exists()


def test_collect_with_another_preset_than_the_sweeps_is_refused(smoke_dir, tmp_path, capsys):
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)  # collecting rewrites the reports: the session's shared sweep is only read
    code, err = repro("--collect", "--out", str(out), "--preset", "quick", capsys=capsys)
    assert code == 2 and "--preset quick: the sweep in" in err[-1] and "was made with preset smoke" in err[-1]
    assert repro("--collect", "--out", str(out), "--preset", "smoke", capsys=capsys)[0] == 0


def test_a_partial_preset_json_is_named_with_what_it_lacks(smoke_dir, tmp_path, capsys):
    record = read_json(smoke_dir / "preset.json")
    del record["preset"]["name"]
    (tmp_path / "preset.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"preset.json lacks the preset's name; it is damaged or partial"): preset_from_record(tmp_path)
    code, err = repro("--collect", "--out", str(tmp_path), capsys=capsys)
    assert code == 2 and len(err) == 1 and "lacks the preset's name" in err[0]
    (tmp_path / "preset.json").write_text(json.dumps({"preset": [1]}))
    assert "holds no preset" in repro("--collect", "--out", str(tmp_path), capsys=capsys)[1][-1]


def test_a_finished_cell_with_a_damaged_checkpoint_is_named(smoke_dir, tmp_path, capsys):
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    key = plan(PRESETS["smoke"])[0].key
    (out / "runs" / key / "checkpoint.pt").write_bytes(b"\0garbage")
    for argv in (["--collect", "--out", str(out)], ["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"]):
        code, err = repro(*argv, capsys=capsys)
        assert code == 2 and len(err) == 1 and "checkpoint.pt is not a readable checkpoint" in err[0] and key in err[0], err
    (out / "runs" / key / "checkpoint.pt").unlink()  # deleted to save space: the record still counts
    assert repro("--collect", "--out", str(out), capsys=capsys)[0] == 0


@pytest.mark.parametrize("name", ["locks", "runs", "bases"])
def test_a_sweep_folder_that_is_a_file_is_named_before_preset_json(tmp_path, capsys, name):
    out = tmp_path / "sweep"; out.mkdir(); (out / name).write_text("x")
    code, err = repro("--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1", capsys=capsys)
    assert code == 2 and f"{out / name} is a file, not a directory (the sweep keeps its {name} there)" in err[-1]
    assert sorted(os.listdir(out)) == [name]  # no preset.json


def test_a_jobs_folder_that_is_a_file_is_named_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("submitit")
    (tmp_path / "jobs-file").write_text("x")
    out = tmp_path / "sweep"
    code, err = repro("--preset", "smoke", "--out", str(out), "--quiet", "--executor", "submitit", "--cluster", "local",
                      "--jobs-folder", str(tmp_path / "jobs-file"), capsys=capsys)
    assert code == 2 and err[-1].startswith("basedirected-repro: error: --jobs-folder:") and "is a file, not a directory" in err[-1]
    assert not (out / "preset.json").exists()


def test_a_read_only_jobs_folder_is_named(tmp_path, capsys):
    pytest.importorskip("submitit")
    ro = tmp_path / "ro"; ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here (needs root)")
    try:
        code, err = repro("--preset", "smoke", "--out", str(tmp_path / "sweep"), "--quiet", "--executor", "submitit", "--cluster", "local",
                          "--jobs-folder", str(ro / "jobs"), capsys=capsys)
        assert code == 2 and "--jobs-folder" in err[-1] and "is not writable" in err[-1], err
        assert not (tmp_path / "sweep" / "preset.json").exists()
    finally: subprocess.run(["umount", str(ro)])


def test_the_objective_refuses_a_negative_kl():
    from basedirected.objective import ReconstructionLossConfig, j_celbo, j_theta, objective
    from basedirected.reconstruction import reconstruction_terms
    nll, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"kl must be >= 0 \(a KL divergence\), got -0.5"):
        objective(nll, nll, mask, 1.0, torch.tensor([0.1, -0.5]), 0.1, ReconstructionLossConfig.theta())
    terms = reconstruction_terms(nll, nll, mask, 1.0)
    for j in (j_theta, j_celbo):
        with pytest.raises(ValueError, match="kl must be >= 0"): j(terms, torch.tensor([-1.0, 0.0]), 0.1)
    assert torch.isfinite(objective(nll, nll, mask, 1.0, torch.tensor([0.1, -1e-7]), 0.1, ReconstructionLossConfig.theta())["loss"])  # round-off


def test_every_value_option_says_its_default():
    from basedirected.repro import repro_main  # noqa: F401  (its parser is built inside repro_main)
    p = build_parser()
    for a in p._actions:
        if a.option_strings and a.nargs != 0 and a.dest != "help":
            assert "default" in (a.help or ""), f"{a.option_strings[0]} does not say its default: {a.help!r}"


@pytest.mark.parametrize("command, argv, message", [
    ("train", ["--stesp", "3"], "basedirected-train: error: unrecognized option --stesp (did you mean --steps?); see basedirected-train --help"),
    ("train", ["--run-dirr", "x"], "unrecognized option --run-dirr (did you mean --run-dir?)"),
    ("train", ["--objective", "thetaa"], "argument --objective: invalid choice: 'thetaa'"),
    ("repro", ["--prest", "quick"], "basedirected-repro: error: unrecognized option --prest (did you mean --preset?); see basedirected-repro --help"),
    ("repro", ["--zzz"], "basedirected-repro: error: unrecognized option --zzz; see basedirected-repro --help"),
])
def test_a_typo_is_one_line_with_the_closest_option(capsys, command, argv, message):
    code, err = (train if command == "train" else repro)(*argv, capsys=capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err


USER_TASK = '''
from dataclasses import dataclass
from basedirected.tasks import Task, TaskCheck

@dataclass(frozen=True)
class Reverse(Task):
    name = "user_reverse"
    deterministic = True
    strategies: tuple = ("forward", "backward")
    @property
    def tokens(self): return tuple(str(d) for d in range(10))
    def sample_input(self, rng): return tuple(rng.randrange(10) for _ in range(3))
    def render(self, x, strategy, rng=None): return tuple(str(d) for d in (x if strategy == 0 else x[::-1]))
    def check(self, x, y):
        ss = tuple(s for s in range(2) if self.render(x, s) == tuple(y))
        return TaskCheck(bool(ss), ss, bool(ss))
'''


@pytest.mark.parametrize("task", ["visiting_order", "sorting", "grid_pathfinding", "addition", "fresh_tasks:Reverse"])
def test_a_run_of_every_task_loads_in_a_fresh_process(tmp_path, monkeypatch, capsys, task):
    "`load_run` in a process that imported only basedirected.runs (and the user's own task module): built-in tasks are registered with it, a user's module:Class is recorded and found."
    from basedirected.tasks import Task
    monkeypatch.setattr(Task, "registry", dict(Task.registry))  # the user's task registers here, not for the tests after this one
    monkeypatch.delitem(sys.modules, "fresh_tasks", raising=False)
    (tmp_path / "fresh_tasks.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path); monkeypatch.syspath_prepend(str(tmp_path))
    tiny = ["--n-train", "300", "--n-eval", "16", "--c-samples", "16", "--base-steps", "5", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
            "--d-ff", "32", "--steps", "2", "--batch-size", "4", "--eval-every", "2", "--checkpoint-every", "2", "--quiet", "--allow-failed-base",
            "--no-metrics", "--max-len", "128"]
    assert train("--run-dir", str(tmp_path / "run"), "--task", task, *tiny, capsys=capsys)[0] == 0
    user = "import fresh_tasks; " if ":" in task else ""  # a record never imports code: the user imports their own task
    code = (f"import sys; {user}from basedirected.runs import load_run; r = load_run(sys.argv[1]); "
            "assert 'basedirected.cli' not in sys.modules; print(type(r.task).__name__, r.task.name)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == (task if ":" not in task else "user_reverse")


@pytest.mark.parametrize("value, message", [("-1", "--code-init-noise must be finite and >= 0, got -1.0"), ("inf", "got inf"), ("nan", "got nan")])
def test_the_code_initialization_scale_is_an_option_that_refuses_bad_values(tmp_path, capsys, value, message):
    from basedirected.config import config_from_args
    assert config_from_args(build_parser().parse_args(["--code-init-noise", "0.3"])).cvae.code_init_noise == 0.3
    code, err = train("--run-dir", str(tmp_path / "run"), "--code-init-noise", value, capsys=capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_api_and_the_command_line_resolve_the_same_configuration():
    "resolve_config (the API) and basedirected-train's options build one RunConfig for every task and objective, with and without changes."
    from basedirected.objective import OBJECTIVE_NAMES
    from basedirected.config import resolve_config
    from basedirected.tasks import Task
    from basedirected.config import build_parser, config_from_args
    parse = lambda argv: config_from_args(build_parser().parse_args(argv))
    for task in Task.registry:
        for objective in OBJECTIVE_NAMES:
            assert resolve_config(task, objective) == parse(["--task", task, "--objective", objective]), (task, objective)
        changed = {"train.steps": 700, "train.tau": 0.07, "cvae.posterior": "exact", "cvae.K": 3, "base.steps": 50}
        assert resolve_config(task, "theta", changed, alpha=0.0, gamma=2.0) == parse(
            ["--task", task, "--steps", "700", "--tau", "0.07", "--posterior", "exact", "--K", "3", "--base-steps", "50", "--alpha", "0", "--gamma", "2"])
    assert resolve_config("sorting").base.steps == 5000 != RunConfig().base.steps  # the recipe's base, which RunConfig's defaults are not
