"""Fault injection: what survives a kill, what a NaN does, what --force removes, damaged files, changed configurations,
and the errors a user meets on a bad day (each a one-line exit-2 message that names the option or file)."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from basedirected.distributions import categorical_kl, gaussian_kl
from basedirected.model import collate
from basedirected.objective import ReconstructionLossConfig, objective
from basedirected.reconstruction import aggregate
from basedirected.runs import RunDir, load_run, prepare_run, read_log
from basedirected.config import resolve_config
from basedirected.tasks import Vocab
from basedirected.cli import train_main
from basedirected.config import build_parser, config_from_args
from basedirected.train import NonFiniteError, run
from basedirected.visiting_order import VisitingOrder
from basedirected.weights import concentration_factor, reconstruction_weights

TINY = ["--task", "visiting_order", "--posterior", "amortized", "--n-train", "600", "--n-eval", "32", "--c-samples", "64", "--base-steps", "40", "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--d-ff", "64", "--K", "3", "--steps", "8", "--batch-size", "8", "--eval-every", "4", "--checkpoint-every", "4", "--quiet", "--allow-failed-base"]


def tiny(*extra):
    return config_from_args(build_parser().parse_args([*TINY, *extra]))


def cli(run_dir, *extra, capsys=None):
    "Exit status and last stderr line of `basedirected-train` in-process."
    try:
        code = train_main(["--run-dir", str(run_dir), *TINY, *extra])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines() if capsys else []
    return code, (err[-1] if err else "")


def weights_of(path):
    return torch.load(path, weights_only=True)["model"]


# --- kills and resumes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stop", [1, 3, 4, 6])
def test_a_run_stopped_at_any_step_resumes_to_the_same_result(tmp_path, stop):
    cfg = tiny()
    straight = run(tmp_path / "straight", cfg, device="cpu")
    run(tmp_path / "cut", cfg, device="cpu", stop_after=stop)
    assert run(tmp_path / "cut", cfg, device="cpu") == straight
    a, b = weights_of(tmp_path / "straight" / "checkpoint.pt"), weights_of(tmp_path / "cut" / "checkpoint.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_during_training_then_resume_gives_the_uninterrupted_result(tmp_path):
    args = ["--run-dir", str(tmp_path / "killed"), *TINY, "--steps", "40", "--checkpoint-every", "5", "--eval-every", "20"]
    code = "import sys; from basedirected.cli import train_main; train_main(sys.argv[1:])"
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = tmp_path / "killed" / "checkpoint.pt"
    deadline = time.time() + 120
    while not ck.exists() and time.time() < deadline and p.poll() is None: time.sleep(0.05)
    p.send_signal(signal.SIGKILL); p.wait()
    assert ck.exists(), "the run never wrote a checkpoint"
    assert train_main(args) == 0  # resumes
    assert train_main(["--run-dir", str(tmp_path / "straight"), *args[2:]]) == 0
    a, b = weights_of(ck), weights_of(tmp_path / "straight" / "checkpoint.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda log: [{k: v for k, v in r.items() if k != "examples_per_s"} for r in log]
    assert strip(read_log(tmp_path / "killed" / "log.jsonl")) == strip(read_log(tmp_path / "straight" / "log.jsonl"))


def _run_killed_at(run_dir, args, wait_for, timeout=180):
    "Start `basedirected-train args` in a process, kill -9 it as soon as `wait_for` exists in `run_dir` (or it ends), return whether the file appeared."
    code = "import sys; from basedirected.cli import train_main; train_main(sys.argv[1:])"
    p = subprocess.Popen([sys.executable, "-c", code, "--run-dir", str(run_dir), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not (run_dir / wait_for).exists() and time.time() < deadline and p.poll() is None: time.sleep(0.01)
    p.send_signal(signal.SIGKILL); p.wait()
    while True:  # the killed process's lock on the run directory is gone once its last descriptor closes
        try:
            fd = os.open(run_dir, os.O_RDONLY); import fcntl; fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); fcntl.flock(fd, fcntl.LOCK_UN); os.close(fd); break
        except BlockingIOError: os.close(fd); time.sleep(0.05)
    return (run_dir / wait_for).exists()


PHASES = ["--task", "visiting_order", "--posterior", "exact", "--n-train", "600", "--n-eval", "32", "--c-samples", "400", "--base-steps", "400", "--d-model", "16",
          "--n-layers", "1", "--n-heads", "2", "--d-ff", "32", "--K", "3", "--steps", "20", "--batch-size", "8", "--eval-every", "10", "--checkpoint-every", "5",
          "--n-routed", "64", "--n-forced", "32", "--quiet", "--allow-failed-base", "--threads", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    "The run of PHASES that nothing interrupts, which every killed run must end equal to."
    d = tmp_path_factory.mktemp("phases") / "straight"
    assert train_main(["--run-dir", str(d), *PHASES]) == 0
    return d


@pytest.mark.parametrize("phase, wait_for", [("base pre-training", "base_checkpoint.pt"), ("c_theta and the gate", "base.pt"),
                                             ("the metrics", "eval.json")])
def test_kill_9_in_every_phase_then_the_same_command_gives_the_uninterrupted_files(tmp_path, uninterrupted, phase, wait_for):
    "A base trained here checkpoints its pre-training: a kill at any point loses at most the steps since the last state, and the rerun's files are the uninterrupted run's."
    assert _run_killed_at(tmp_path / "killed", PHASES, wait_for), f"the run never reached {phase}"
    assert train_main(["--run-dir", str(tmp_path / "killed"), *PHASES]) == 0
    a, b = tmp_path / "killed", uninterrupted
    for f in ("base.pt", "checkpoint.pt"):
        x, y = torch.load(a / f, weights_only=True)["model"], torch.load(b / f, weights_only=True)["model"]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f
    for f in ("reference_scale.json", "base_gate.json", "eval.json"): assert (a / f).read_text() == (b / f).read_text(), f
    drop = lambda m: {k: v for k, v in m.items() if k != "base_sha256"}  # the same weights may pickle to other bytes
    assert drop(json.loads((a / "metrics.json").read_text())) == drop(json.loads((b / "metrics.json").read_text()))
    strip = lambda log: [{k: v for k, v in r.items() if k != "examples_per_s"} for r in log]
    assert strip(read_log(a / "log.jsonl")) == strip(read_log(b / "log.jsonl")) and not (a / "base_checkpoint.pt").exists()


def test_a_kill_between_saving_the_base_and_removing_its_pretraining_state_leaves_nothing_behind(tmp_path, uninterrupted):
    "The narrow window the kill test hits by chance, made certain: base.pt written, base_checkpoint.pt not yet removed; the rerun removes it and changes nothing else."
    import shutil
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "base_checkpoint.pt").write_bytes((run / "base.pt").read_bytes())
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.name not in ("base_checkpoint.pt", "command.txt")}
    assert train_main(["--run-dir", str(run), *PHASES]) == 0
    assert not (run / "base_checkpoint.pt").exists()
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.name != "command.txt"} == before


# --- non-finite values ---------------------------------------------------------------------------------------------------

def _poison(monkeypatch, at_steps, value=float("nan")):
    "Make the CVAE's token losses non-finite at the given (0-based) steps of training."
    import basedirected.cvae as cvae_module
    real, seen = cvae_module.cvae_forward, {"calls": 0}
    def forward(model, exs, generator=None, eps=None):
        out = real(model, exs, generator, eps)
        if model.training:
            if seen["calls"] in at_steps: out.nll = out.nll * value
            seen["calls"] += 1
        return out
    monkeypatch.setattr(cvae_module, "cvae_forward", forward)


@pytest.mark.parametrize("bad_step", [2, 3])  # step 4 (0-based 3) is a checkpoint step
def test_a_nan_step_is_skipped_and_never_reaches_the_weights_or_the_log(tmp_path, monkeypatch, bad_step):
    _poison(monkeypatch, {bad_step})
    run(tmp_path, tiny(), device="cpu")
    log = read_log(tmp_path / "log.jsonl")
    assert [r["skipped"] for r in log if "skipped" in r] == ["nll"]
    assert "NaN" not in (tmp_path / "log.jsonl").read_text()
    assert all(torch.isfinite(v).all() for v in weights_of(tmp_path / "checkpoint.pt").values())


def test_too_many_nan_steps_stop_the_run_naming_step_and_term_and_keep_the_checkpoint(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, set(range(5, 8)))
    code, line = cli(tmp_path, "--max-nonfinite-steps", "1", capsys=capsys)
    assert code == 2 and "step 7: nll is not finite" in line and "last good checkpoint is kept" in line
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 4


def test_an_exploding_loss_is_warned_about(tmp_path, monkeypatch):
    _poison(monkeypatch, {6}, value=1e6)
    with pytest.warns(UserWarning, match="step 7: loss .* over 100x its running median"):
        run(tmp_path, tiny("--steps", "12", "--checkpoint-every", "12", "--eval-every", "12"), device="cpu")


# --- damaged files --------------------------------------------------------------------------------------------------------

def test_a_partial_last_log_line_is_dropped_and_a_corrupt_middle_line_is_named(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    with open(tmp_path / "log.jsonl", "a") as f: f.write('{"step": 5, "split": "tr')
    assert cli(tmp_path, capsys=capsys)[0] == 0
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    lines[2] = "garbage"
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n")
    assert cli(tmp_path, capsys=capsys) == (2, f"basedirected-train: error: {tmp_path / 'log.jsonl'} line 3 is not valid JSON; "
                                                 "the log is damaged (delete the run or rerun with --force)")


def test_a_missing_log_with_a_checkpoint_is_an_error_unless_asked(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    (tmp_path / "log.jsonl").unlink()
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and "log.jsonl is missing" in line and "--resume-without-log" in line
    assert cli(tmp_path, "--resume-without-log", capsys=capsys)[0] == 0
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl") if r["split"] == "train"] == [5, 6, 7, 8]


@pytest.mark.parametrize("name, content, message", [
    ("checkpoint.pt", b"\x00garbage", "checkpoint.pt is not a readable checkpoint"),
    ("config.json", b"{ not json", "config.json is not valid JSON"),
    ("reference_scale.json", b"[1, 2", "reference_scale.json is not valid JSON"),
    ("reference_scale.json", b"{}", "reference_scale.json lacks the c_theta estimates"),
])
def test_damaged_files_are_named_with_a_fix(tmp_path, capsys, name, content, message):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    (tmp_path / name).write_bytes(content)
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and message in line and "weights_only" not in line


def _checkpoint_without(key):
    def damage(path):
        ck = torch.load(path, weights_only=True); del ck[key]; torch.save(ck, path)
    return damage


def _nan_weight(path):
    ck = torch.load(path, weights_only=True)
    name = next(k for k, t in ck["model"].items() if t.is_floating_point())
    ck["model"][name][0] = float("nan"); torch.save(ck, path)


@pytest.mark.parametrize("name, damage, message", [
    ("log.jsonl", lambda p: p.write_text("[1, 2]\n" + p.read_text()), "log.jsonl line 1 is not a log record"),
    ("log.jsonl", lambda p: p.write_text('{"split": "train"}\n' + p.read_text()), "log.jsonl line 1 is not a log record"),
    ("log.jsonl", lambda p: p.write_bytes(b'{"step": 1, "x": "\xff"}\n' + p.read_bytes()), "log.jsonl line 1 is not valid JSON"),
    ("checkpoint.pt", _checkpoint_without("step"), "checkpoint.pt lacks step"),
    ("checkpoint.pt", _checkpoint_without("model"), "checkpoint.pt lacks model"),
    ("checkpoint.pt", _nan_weight, "checkpoint.pt holds non-finite weights"),
    ("config.json", lambda p: p.write_text("[]"), "config.json holds a JSON list, not the object this package writes"),
    ("config.json", lambda p: (p.unlink(), p.mkdir()), "config.json is a directory, not a file"),
    ("config.json", lambda p: p.write_text('{"config": {}}'), "config.json is not a run record of this package"),
    ("reference_scale.json", lambda p: p.write_text("0.04"), "reference_scale.json holds a JSON float"),
    ("reference_scale.json", lambda p: p.write_text(p.read_text().replace('"value": ', '"value": -1, "was": ', 1)), "estimate of c_theta is -1, not a positive number"),
    ("reference_scale.json", lambda p: p.write_text(p.read_text().replace('"value": ', '"value": NaN, "was": ', 1)), "estimate of c_theta is nan"),
    ("reference_scale.json", lambda p: p.write_text(p.read_text().replace('"value": ', '"was": ', 1)), "estimate of c_theta is None"),
    ("base.pt", lambda p: torch.save({"steps": 40}, p), "base.pt holds no model"),
    ("base_gate.json", lambda p: p.write_text('{"garbage": true}'), "base_gate.json holds no gate verdict"),
])
def test_damaged_run_files_are_named_before_any_work(tmp_path, capsys, name, damage, message):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    damage(tmp_path / name)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and message in line and str(tmp_path) in line, line
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}  # refused before writing anything


def test_a_failed_torch_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    "torch's writer reports a full disk as RuntimeError, not OSError."
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    real_save = torch.save
    def failing(obj, f, *a, **k):
        if "checkpoint" in str(f): raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 448 vs 342\nPytorchStreamWriter failed writing file data/0: file write failed")
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", failing)
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and "checkpoint.pt: could not write it (PytorchStreamWriter failed writing file data/0: file write failed)" in line
    assert (tmp_path / "checkpoint.pt").read_bytes() == before and not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_force_leaves_a_directory_whose_config_json_is_not_a_run_alone(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"lr": 0.1}'); (tmp_path / "eval.json").write_text("{}")
    code, line = cli(tmp_path, "--force", capsys=capsys)
    assert code == 2 and "is not a run directory" in line
    assert sorted(os.listdir(tmp_path)) == ["config.json", "eval.json"]


def test_an_empty_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli("", capsys=capsys) == (2, "basedirected-train: error: --run-dir must name a directory, got an empty string")
    assert os.listdir(tmp_path) == []


def test_the_api_warns_when_it_adapts_from_a_base_that_fails_the_gate(tmp_path):
    with pytest.warns(UserWarning, match=r"fails the quality gate \(.*base_gate.json"):
        run(tmp_path, tiny(), device="cpu", stop_after=1)


def test_repro_refuses_an_out_below_a_file_in_one_line(tmp_path, capsys):
    from basedirected.repro import repro_main
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e: repro_main(["--preset", "smoke", "--out", str(tmp_path / "f" / "sweep"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == f"basedirected-repro: error: --out {tmp_path / 'f' / 'sweep'}: Not a directory"


def test_a_truncated_base_is_named(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    data = (tmp_path / "base.pt").read_bytes()
    (tmp_path / "base.pt").write_bytes(data[: len(data) // 2])
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and "base.pt is not a readable checkpoint" in line


def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    (tmp_path / "config.json").unlink()  # the only record left of the old configuration is inside the checkpoint
    code, line = cli(tmp_path, "--alpha", "0.9", capsys=capsys)
    assert code == 2 and "checkpoint.pt was written by a run with another configuration" in line


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    real_save = torch.save
    def full_disk(obj, f, *a, **k):
        if "checkpoint" in str(f): raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    code, line = cli(tmp_path, capsys=capsys)
    assert code == 2 and "No space left on device" in line
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


# --- the command line ------------------------------------------------------------------------------------------------------

def test_force_on_a_run_directory_removes_only_what_the_package_wrote(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    (tmp_path / "notes.txt").write_text("mine")
    assert cli(tmp_path, "--force", "--steps", "2", capsys=capsys)[0] == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--force"], "is not a run directory (no config.json written by this package); nothing was deleted"),
    (["--device", "foo"], "device must be 'auto', 'cpu' or 'cuda[:i]', got 'foo'"),
    (["--seed", str(2**70)], "--seed must be <= 2,147,483,647 (seeds are integers in [0, 2**31)), got 1180591620717411303424"),
    (["--n-train", "1"], "--n-train must be >= 2"),
    (["--K", "1"], "pass --allow-inert"),
    (["--gamma", "1", "--token-weighted-reconstruction-alpha", "2"], "set the same option; give only one"),
])
def test_bad_input_exits_2_before_any_work(tmp_path, capsys, extra, message):
    (tmp_path / "precious.txt").write_text("x")
    code, line = cli(tmp_path, *extra, capsys=capsys)
    assert code == 2 and message in line
    assert os.listdir(tmp_path) == ["precious.txt"]  # nothing written, nothing deleted


def test_a_run_dir_that_is_a_file_or_under_one_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert cli(tmp_path / "f", capsys=capsys)[1].endswith("is a file, not a directory")
    assert "is a file, not a directory" in cli(tmp_path / "f" / "run", capsys=capsys)[1]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_a_read_only_run_dir_is_refused(tmp_path, capsys):
    d = tmp_path / "ro"; d.mkdir(); d.chmod(0o500)
    try: assert "is not writable" in cli(d / "run", capsys=capsys)[1]
    finally: d.chmod(0o700)


def test_an_existing_run_with_another_configuration_is_refused(tmp_path, capsys):
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    code, line = cli(tmp_path, "--beta", "0.7", capsys=capsys)
    assert code == 2 and "holds a run with a different configuration" in line


# --- the API's gaps ----------------------------------------------------------------------------------------------------------

def test_api_bad_input_raises_value_errors_that_name_the_argument():
    vocab = Vocab.for_task(VisitingOrder())
    with pytest.raises(ValueError, match="examples is empty"): collate(vocab, [])
    with pytest.raises(ValueError, match="q_logits has NaN"): categorical_kl(torch.tensor([[float("nan"), 0.0]]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="K >= 1"): categorical_kl(torch.zeros(3, 0), torch.zeros(3, 0))
    assert torch.isfinite(categorical_kl(torch.tensor([[0.0, float("-inf")]]), torch.zeros(1, 2))).all()
    with pytest.raises(ValueError, match="mu_q has NaN or inf"): gaussian_kl(*(torch.tensor([[float("nan")]]),) + (torch.zeros(1, 1),) * 3)
    nll, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="example_weight has NaN or inf"): aggregate(nll, nll / 3, mask, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="kl_for_loss has NaN"):
        objective(nll, nll, mask, 1.0, torch.zeros(2), 0.1, ReconstructionLossConfig.celbo(), kl_for_loss=torch.tensor(float("inf")))
    denormal = torch.full((1, 3), 1e-45)
    assert concentration_factor(denormal, torch.ones(1, 3), 1.0).item() == 1.0
    assert torch.isfinite(reconstruction_weights(denormal, torch.ones(1, 3), 0.5, 1.0)).all()


def test_api_edge_inputs_raise_value_errors_instead_of_nan():
    from basedirected.metrics import alignment_one_to_one, code_perplexity, latent_information, strategy_information
    from basedirected.objective import j_celbo, j_theta, loss_reference_weights, loss_token_weights
    from basedirected.reconstruction import reconstruction_terms
    from basedirected.surprisal import base_mean
    from basedirected.weights import uniform_weights
    empty = torch.zeros(0, 3)
    for f in (lambda: reconstruction_weights(empty, empty, 0.5, 1.0), lambda: reconstruction_terms(empty, empty, empty, 1.0),
              lambda: base_mean(empty, empty), lambda: objective(empty, empty, empty, 1.0, torch.zeros(0), 0.1, ReconstructionLossConfig.theta())):
        with pytest.raises(ValueError, match="the batch is empty"): f()
    b, mask = torch.rand(2, 3) + 0.1, torch.ones(2, 3)
    cfg = ReconstructionLossConfig.theta()
    with pytest.raises(ValueError, match="c_ref must be > 0"): loss_token_weights(b, mask, 0.0, cfg)
    with pytest.raises(ValueError, match=r"rows \[1\] of mask have no supervised token"): uniform_weights(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="N, K >= 1"): latent_information(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="N, K >= 1"): code_perplexity(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="N, K >= 1"): strategy_information(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one row with a known strategy"): strategy_information(torch.full((2, 2), 0.5), torch.tensor([-1, -1]))
    uninformative = torch.full((4, 2), 0.5)
    assert strategy_information(uninformative, torch.tensor([0, 1, -1, -1])) == pytest.approx(0.0)  # unknown strategies are left out
    assert strategy_information(torch.eye(2).repeat(2, 1), torch.tensor([0, 1, 0, -1])) == pytest.approx(1.0)
    assert alignment_one_to_one([[1e308, 0], [0, 1e308]]) == 1.0 and alignment_one_to_one([[3e307, 1e307], [0, 4e307]]) == pytest.approx(7 / 8)
    terms = reconstruction_terms(b, b, mask, 1.0)
    for j in (j_theta, j_celbo):
        with pytest.raises(ValueError, match="kl has NaN or inf"): j(terms, torch.tensor([0.1, float("nan")]), 0.1)


def test_a_shared_base_is_keyed_by_its_configuration(tmp_path):
    import dataclasses
    from basedirected.experiments import execute
    from basedirected.presets import PRESETS
    preset = dataclasses.replace(PRESETS["smoke"], objectives=("celbo",), posteriors=("exact",))
    execute(tmp_path, preset, progress=False)
    changed = dataclasses.replace(preset, base_steps=preset.base_steps + 5)
    (record,) = execute(tmp_path, changed, progress=False)
    for d in (tmp_path / "bases" / "early-s0", tmp_path / "runs" / record["key"]):
        assert torch.load(d / "base.pt", weights_only=True)["base_config"]["steps"] == changed.base_steps
        assert json.loads((d / "reference_scale.json").read_text())["base"]["base_config"]["steps"] == changed.base_steps


def test_the_cli_refuses_a_base_that_fails_the_quality_gate_unless_asked(tmp_path, capsys):
    args = [a for a in TINY if a != "--allow-failed-base"]
    try: code = train_main(["--run-dir", str(tmp_path), *args])
    except SystemExit as e: code = e.code
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "fails the quality gate" in line and "--allow-failed-base" in line
    gate = json.loads((tmp_path / "base_gate.json").read_text())
    assert gate["passes"] is False and not (tmp_path / "checkpoint.pt").exists()  # no CVAE was trained


def _processes_in_group(pgid):
    "Pids of live (not zombie) processes in process group `pgid`."
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try: fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError: continue
        if int(fields[2]) == pgid and fields[0] != "Z": pids.append(int(p))
    return pids


def test_a_sweep_killed_with_kill_9_leaves_no_process_of_its_own_alive(tmp_path):
    "Its pool workers watch their parent (die_with_parent); the resource tracker exits when its last client does."
    out = tmp_path / "sweep"
    sweep = subprocess.Popen([sys.executable, "-c", "from basedirected.repro import repro_main; repro_main()", "--preset", "smoke",
                              "--out", str(out), "--jobs", "2", "--quiet"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while time.time() - t0 < 120 and not list((out / "runs").glob("*/config.json")): time.sleep(0.2)  # workers are training cells
    assert list((out / "runs").glob("*/config.json")), "no cell started"
    assert len(_processes_in_group(sweep.pid)) >= 3  # the sweep, its workers and the resource tracker
    os.kill(sweep.pid, signal.SIGKILL); sweep.wait()
    t0 = time.time()
    while time.time() - t0 < 10 and _processes_in_group(sweep.pid): time.sleep(0.2)
    left = _processes_in_group(sweep.pid)
    if left: os.killpg(sweep.pid, signal.SIGKILL)  # leave no orphans behind a failure
    assert left == [], "processes of the killed sweep are still running"


def test_a_sweep_cell_waits_for_a_live_process_holding_it_and_cleans_its_debris(tmp_path):
    import dataclasses
    import threading
    from basedirected.experiments import execute, lock_path, run_cell
    from basedirected.presets import PRESETS, plan
    from basedirected.runs import file_lock
    preset = dataclasses.replace(PRESETS["smoke"], objectives=("celbo",), posteriors=("exact",))
    spec = plan(preset)[0]
    execute(tmp_path, preset, progress=False)
    rd = RunDir(tmp_path / "runs" / spec.key)
    rd.metrics.unlink()  # unfinished again
    debris = rd.path / ".checkpoint.pt.tmp99999"; debris.write_bytes(b"half a checkpoint")
    done = threading.Event()
    with file_lock(lock_path(tmp_path, spec.key)):  # another process training the cell
        worker = threading.Thread(target=lambda: (run_cell(tmp_path, spec), done.set())); worker.start()
        time.sleep(2.0)
        assert not done.is_set() and debris.exists()  # it waits, and touches nothing
    worker.join(timeout=120)
    assert done.is_set() and rd.metrics.exists() and not debris.exists()


def test_repro_force_removes_only_what_the_package_wrote(tmp_path):
    import dataclasses
    from basedirected.experiments import base_dir, execute
    from basedirected.presets import PRESETS, plan
    preset = dataclasses.replace(PRESETS["smoke"], objectives=("celbo",), posteriors=("exact",))
    execute(tmp_path, preset, progress=False)
    spec = plan(preset)[0]
    mine = [base_dir(tmp_path, spec.regime, spec.config.data_seed) / "notes.txt", tmp_path / "bases" / "my-own-base" / "base.pt",
            tmp_path / "runs" / spec.key / "notes.txt"]
    for f in mine: f.parent.mkdir(parents=True, exist_ok=True); f.write_text("a user's file")
    before = os.path.getmtime(tmp_path / "runs" / spec.key / "metrics.json")
    time.sleep(0.01)
    execute(tmp_path, preset, progress=False, force=True)
    assert os.path.getmtime(tmp_path / "runs" / spec.key / "metrics.json") > before  # rerun
    assert all(f.read_text() == "a user's file" for f in mine)


@pytest.mark.parametrize("path, damage, message", [
    ("runs/{key}/metrics.json", lambda p: p.write_text("{ garbage"), "metrics.json is not valid JSON; delete it or rerun with --force"),
    ("runs/{key}/config.json", lambda p: p.write_text("[]"), "config.json holds a JSON list"),
    ("runs/{key}/checkpoint.pt", lambda p: (p.write_bytes(b"\x00garbage"), (p.parent / "metrics.json").unlink()), "checkpoint.pt is not a readable checkpoint"),
    ("bases/early-s0/base.pt", lambda p: (torch.save({"steps": 40}, p), next(p.parent.parent.parent.glob("runs/*/metrics.json")).unlink()),
     "base.pt holds no base model"),
])
def test_a_sweeps_damaged_files_are_named_in_one_line(smoke_dir, tmp_path, capsys, path, damage, message):
    import shutil
    from basedirected.presets import PRESETS, plan
    from basedirected.repro import repro_main
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    damage(out / path.format(key=plan(PRESETS["smoke"])[0].key))
    with pytest.raises(SystemExit) as e: repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0] and str(out) in err[0], err


def test_a_finished_run_whose_final_eval_record_was_torn_writes_it_again(tmp_path, capsys):
    assert cli(tmp_path, capsys=capsys)[0] == 0
    log = (tmp_path / "log.jsonl").read_text().splitlines()
    final = json.loads(log[-1]); assert final["split"] == "eval" and final["step"] == 8
    (tmp_path / "log.jsonl").write_text("\n".join(log[:-1]) + "\n" + log[-1][: len(log[-1]) // 2])  # torn by a kill
    assert cli(tmp_path, capsys=capsys)[0] == 0
    assert read_log(tmp_path / "log.jsonl") == [json.loads(l) for l in log]  # the same record, rewritten


def test_max_len_too_short_for_the_task_is_refused_before_anything_is_written(tmp_path, capsys):
    code, line = cli(tmp_path / "run", "--max-len", "20", capsys=capsys)
    assert code == 2 and "--max-len 20 is shorter than the task's longest sequence (21 tokens" in line
    assert not (tmp_path / "run").exists()


def test_a_run_directory_in_use_is_refused_and_a_rerun_clears_a_killed_writers_temporaries(tmp_path, capsys):
    import fcntl
    run(tmp_path, tiny(), device="cpu", stop_after=4)
    debris = [tmp_path / ".checkpoint.pt.tmp99999", tmp_path / ".log.jsonl.tmp99998"]
    for p in debris: p.write_bytes(b"half a file")
    (tmp_path / ".notes.txt.tmp1").write_text("a user's file")
    fd = os.open(tmp_path, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)  # another process running in it
    try: code, line = cli(tmp_path, capsys=capsys)
    finally: os.close(fd)
    assert code == 2 and "another process is running in this run directory" in line and all(p.exists() for p in debris)
    assert cli(tmp_path, capsys=capsys)[0] == 0
    assert not any(p.exists() for p in debris) and (tmp_path / ".notes.txt.tmp1").exists()


# --- two processes, one run directory ---------------------------------------------------------------------------------------

TRAIN = "import sys; from basedirected.cli import train_main; sys.exit(train_main(sys.argv[1:]))"
LONG_BASE = [*TINY[:TINY.index("--base-steps")], "--base-steps", "200000", *TINY[TINY.index("--base-steps") + 2:]]  # busy for minutes


def _default_sigint():
    "In the child before exec: Ctrl-C's default action, which a shell's background job (`cmd &`) would otherwise hand down as ignored."
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(run_dir, *extra):
    return subprocess.Popen([sys.executable, "-c", TRAIN, "--run-dir", str(run_dir), *LONG_BASE, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def _held_elsewhere(path):
    "Another process holds the run directory's lock (what a second process finds)."
    import fcntl
    try: fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError: return False
    try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); return False
    except BlockingIOError: return True
    finally: os.close(fd)


def _wait_until(condition, p, timeout=120):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline and p.poll() is None: time.sleep(0.05)
    assert condition(), f"the first process never got there (exit {p.poll()}): {p.stderr.read() if p.poll() is not None else ''}"


def _second(run_dir, *extra):
    q = subprocess.run([sys.executable, "-c", TRAIN, "--run-dir", str(run_dir), *TINY, *extra], capture_output=True, text=True, timeout=300)
    return q.returncode, q.stderr.strip().splitlines()


@pytest.mark.parametrize("existing", [False, True])
def test_a_second_process_on_a_live_run_directory_is_refused_and_deletes_nothing(tmp_path, existing):
    "New or existing directory, with or without --force: the first process holds it from before its first write."
    d = tmp_path / "run"
    if existing: run(d, tiny(), device="cpu", stop_after=4)  # an existing run the first process resumes
    first = _start(d, *(["--force"] if existing else []))  # (a resume of a changed configuration needs --force)
    try:
        _wait_until(lambda: _held_elsewhere(d) and (d / "config.json").exists(), first)
        before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
        for extra in ([], ["--force"], ["--steps", "2"]):
            code, err = _second(d, *extra)
            assert code == 2 and "another process is running in this run directory" in err[-1], err
        assert first.poll() is None  # the first run goes on
        live = ("log.jsonl", "base_checkpoint.pt")  # what the first process itself goes on writing
        assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name not in live} == \
               {k: v for k, v in before.items() if k not in live}  # nothing deleted or replaced
    finally:
        first.kill(); first.wait()
    assert not _held_elsewhere(d)  # the lock dies with its process


def test_the_api_holds_the_run_directory_too(tmp_path):
    from basedirected.runs import exclusive_run_dir
    d = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from basedirected.runs import exclusive_run_dir\n"
                               f"with exclusive_run_dir({str(d)!r}): print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another process is running in this run directory"): run(d, tiny(), device="cpu")
        with pytest.raises(ValueError, match="another process is running"):
            with exclusive_run_dir(d): pass
        assert os.listdir(d) == []
    finally:
        holder.kill(); holder.wait()
    run(d, tiny(), device="cpu", stop_after=2)  # free again


def test_ctrl_c_is_one_line_and_the_rerun_resumes(tmp_path):
    d = tmp_path / "run"
    first = _start(d)
    _wait_until(lambda: (d / "config.json").exists(), first)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert first.returncode == 130 and "Traceback" not in err and lines[-1].startswith("basedirected-train: interrupted; run the same command again"), err
    assert (d / "config.json").exists()  # what was written stays


def test_two_ctrl_c_in_quick_succession_are_still_one_line(tmp_path):
    d = tmp_path / "run"
    first = _start(d)
    _wait_until(lambda: (d / "config.json").exists(), first)
    first.send_signal(signal.SIGINT); time.sleep(0.05); first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("basedirected-train: interrupted; run the same command again"), err


# --- a user's task, checked before anything is written ------------------------------------------------------------------------

USER_TASKS = '''
from dataclasses import dataclass
from basedirected.tasks import Example, Task, TaskCheck

@dataclass(frozen=True)
class Pair(Task):
    name = "user_pair"
    deterministic = True
    strategies: tuple = ("forward", "backward")
    @property
    def tokens(self): return tuple(str(d) for d in range(10))
    def sample_input(self, rng): return (rng.randrange(10), rng.randrange(10))
    def render(self, x, strategy, rng=None): return tuple(str(d) for d in (x if strategy == 0 else x[::-1]))
    def check(self, x, y):
        ss = tuple(s for s in range(2) if self.render(x, s) == tuple(y))
        return TaskCheck(bool(ss), ss, bool(ss))

class RenderRaises(Pair):
    name = "user_render_raises"
    def render(self, x, strategy, rng=None): raise KeyError("no such digit")
class RenderList(Pair):
    name = "user_render_list"
    def render(self, x, strategy, rng=None): return [str(d) for d in x]
class RenderUnknown(Pair):
    name = "user_render_unknown"
    def render(self, x, strategy, rng=None): return ("ten",)
class CheckRaises(Pair):
    name = "user_check_raises"
    def check(self, x, y): raise ZeroDivisionError("division by zero")
class CheckNone(Pair):
    name = "user_check_none"
    def check(self, x, y): return None
class CheckWrong(Pair):
    name = "user_check_wrong"
    def check(self, x, y): return TaskCheck(True, (1 - int(tuple(y) == self.render(x, 0)),), True)
'''


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    "USER_TASKS as module user_tasks in the working directory, imported afresh, registering into a registry of this test's own."
    from basedirected.tasks import Task
    monkeypatch.setattr(Task, "registry", dict(Task.registry))
    for name in ("user_tasks", "broken_module"): monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "user_tasks.py").write_text(USER_TASKS)
    monkeypatch.chdir(tmp_path); monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("spec, message", [
    ("user_tasks:RenderRaises", "task RenderRaises: sample raised KeyError: 'no such digit'"),
    ("user_tasks:RenderList", "task RenderList: render(x, 0) must return a tuple of token strings"),
    ("user_tasks:RenderUnknown", "task RenderUnknown: render(x, 0) wrote 'ten', which is not in its tokens"),
    ("user_tasks:CheckRaises", "task CheckRaises: check raised ZeroDivisionError: division by zero"),
    ("user_tasks:CheckNone", "task CheckNone: check(x, y) must return a TaskCheck, got NoneType"),
    ("user_tasks:CheckWrong", "task CheckWrong: check(x, render(x, 1)) does not read it as a valid trace of strategy 1"),
    ("broken_module:Pair", "task broken_module:Pair: importing 'broken_module' failed (NameError: name 'undefined_name' is not defined)"),
    (":Pair", "module:Class needs both a module and a class name"),
])
def test_a_users_task_that_cannot_run_is_named_before_anything_is_written(tmp_path, capsys, user_tasks, spec, message):
    (tmp_path / "broken_module.py").write_text("x = undefined_name\n")
    code, line = cli(tmp_path / "run", "--task", spec, capsys=capsys)
    assert code == 2 and message in line, line
    assert not (tmp_path / "run").exists()  # no config.json, base.pt or reference_scale.json


def test_a_users_task_that_works_trains_and_loads_back(tmp_path, capsys, user_tasks):
    code, line = cli(tmp_path / "run", "--task", "user_tasks:Pair", capsys=capsys)  # 100 inputs in all
    assert code == 2 and "task user_pair: cannot find enough unseen inputs" in line and not (tmp_path / "run").exists()
    assert cli(tmp_path / "run", "--task", "user_tasks:Pair", "--n-train", "40", "--n-eval", "16", capsys=capsys)[0] == 0


# --- KL weights that overflow --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--beta", "1e308"], "--beta must be <= 1e+06"),
    (["--tau", "1e308"], "--tau must be <= 1e+06"),
    (["--beta", "inf"], "--beta must be finite"),
])
def test_a_kl_weight_that_cannot_be_finite_is_refused_up_front(tmp_path, capsys, extra, message):
    code, line = cli(tmp_path / "run", *extra, capsys=capsys)
    assert code == 2 and message in line, line
    assert not (tmp_path / "run").exists()


def test_a_kl_weight_resolved_above_the_ceiling_is_refused_before_training(tmp_path, monkeypatch):
    "tau times the task's break-even beta* can pass the ceiling that tau alone does not: refused once beta* is known, before any step."
    import basedirected.runs as runs
    from basedirected.runs import RunInputError
    cfg = tiny("--tau", "0.06")
    monkeypatch.setattr(runs, "MAX_KL_WEIGHT", 1e-9)  # the ceiling, lowered below any tau x beta*
    with pytest.raises(RunInputError, match=r"the KL weight resolves to .* \(tau 0.06 x beta\* .*\), above 1e-09: give a smaller --tau or --beta"):
        run(tmp_path / "run", cfg, device="cpu")
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "log.jsonl").exists()


# --- a full disk, said as such --------------------------------------------------------------------------------------------------

def test_a_full_disk_in_torch_save_says_no_space_left(tmp_path, monkeypatch):
    "torch's writer wraps the file's ENOSPC in a RuntimeError ('enforce fail at inline_container.cc'); the package names the cause."
    from basedirected.runs import atomic_torch_save
    real_save = torch.save
    def torch_like(obj, f, *a, **k):  # what torch does when the file's write fails: the OSError is the RuntimeError's context
        f.write(b"x" * 10)
        try: raise OSError(errno.ENOSPC, "No space left on device")  # the file's write, as torch's writer calls it
        except OSError: raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(torch, "save", torch_like)
    with pytest.raises(OSError) as e: atomic_torch_save(tmp_path / "checkpoint.pt", {"a": torch.zeros(3)})
    assert e.value.errno == errno.ENOSPC and "No space left on device" in str(e.value) and e.value.filename == str(tmp_path / "checkpoint.pt")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(torch, "save", real_save)


def _mount_tmpfs(path, size):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here (needs root)")


def test_a_really_full_disk_during_a_checkpoint_is_one_line_naming_the_cause(tmp_path, capsys):
    d = tmp_path / "small"
    _mount_tmpfs(d, "4m")
    try:
        run(d / "run", tiny(), device="cpu", stop_after=4)
        before = (d / "run" / "checkpoint.pt").read_bytes()
        with open(d / "filler", "wb") as f:  # leave 16 KiB: the log's lines fit, a checkpoint does not
            free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
            f.write(b"\0" * max(free - 16384, 0))
        code, line = cli(d / "run", capsys=capsys)
        assert code == 2 and "No space left on device" in line and "enforce fail" not in line, line
        assert (d / "run" / "checkpoint.pt").read_bytes() == before and not [p for p in os.listdir(d / "run") if ".tmp" in p]
        (d / "filler").unlink()
        assert cli(d / "run", capsys=capsys)[0] == 0  # the disk grown again: it resumes
    finally:
        subprocess.run(["umount", str(d)])


# --- a sweep's cell and basedirected-train -------------------------------------------------------------------------------------

def _cell_command(out, key):
    import shlex
    argv = shlex.split((out / "runs" / key / "command.txt").read_text())
    assert argv[0] == "basedirected-train" and argv[1] == "--run-dir"
    return ["--run-dir", str(out / "runs" / key), *argv[3:]]  # the copy's cell, not the sweep's it was copied from


def test_rerunning_a_finished_cells_command_keeps_the_sweeps_record(smoke_dir, tmp_path, capsys):
    import shutil
    from basedirected.presets import PRESETS, plan
    from basedirected.repro import repro_main
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    key = plan(PRESETS["smoke"])[0].key
    rd = RunDir(out / "runs" / key)
    before = rd.metrics.read_bytes()
    assert train_main(_cell_command(out, key)) == 0
    assert rd.metrics.read_bytes() == before  # the sweep's record (key, K, beta ...) stays
    assert repro_main(["--collect", "--out", str(out)]) == 0


def test_a_cell_record_another_writer_left_is_rewritten_by_the_sweep_and_collect_never_tracebacks(smoke_dir, tmp_path, capsys):
    import shutil
    from basedirected.presets import PRESETS, plan
    from basedirected.repro import repro_main
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    key = plan(PRESETS["smoke"])[0].key
    rd = RunDir(out / "runs" / key)
    sweeps = json.loads(rd.metrics.read_text())
    rd.metrics.write_text(json.dumps({k: v for k, v in sweeps.items() if k not in ("key", "K", "beta")}))  # basedirected-train's record
    assert repro_main(["--collect", "--out", str(out)]) == 1  # not the sweep's: the cell is missing, named, no TypeError
    assert key in capsys.readouterr().out
    assert repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"]) == 0  # the sweep completes it again
    again = json.loads(rd.metrics.read_text())
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in sweeps.items() if k != "seconds"}


def test_a_sweep_and_basedirected_train_never_share_a_cell(smoke_dir, tmp_path, capsys):
    import fcntl
    import shutil
    from basedirected.experiments import cell_locks, run_cell
    from basedirected.presets import PRESETS, plan
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    spec = plan(PRESETS["smoke"])[0]
    rd = RunDir(out / "runs" / spec.key)
    rd.metrics.unlink()  # unfinished again
    fd = os.open(rd.path, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)  # a basedirected-train running in the cell's directory
    try:
        with pytest.raises(ValueError, match="another process is running in this run directory"): run_cell(out, spec)
    finally: os.close(fd)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom basedirected.experiments import cell_locks\nfrom basedirected.presets import PRESETS, plan\n"
                               f"with cell_locks(Path({str(out)!r}), plan(PRESETS['smoke'])[:1]): print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the sweep holds the cell
        code, line = (lambda r: (r, capsys.readouterr().err.strip().splitlines()[-1]))(_exit_code(lambda: train_main(_cell_command(out, spec.key))))
        assert code == 2 and "another process is running in this run directory" in line
    finally: holder.kill(); holder.wait()
    assert not rd.metrics.exists()


def _exit_code(f):
    try: return f()
    except SystemExit as e: return e.code


def test_ctrl_c_in_a_sweep_is_one_line(tmp_path):
    out = tmp_path / "sweep"
    p = subprocess.Popen([sys.executable, "-c", "import sys; from basedirected.repro import repro_main; sys.exit(repro_main(sys.argv[1:]))",
                          "--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_default_sigint)
    _wait_until(lambda: (out / "preset.json").exists(), p)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("basedirected-repro: interrupted; finished cells are kept")


@pytest.mark.parametrize("after", [0.3, 1.0])
def test_a_terminals_ctrl_c_while_the_sweeps_workers_import_is_one_line(tmp_path, after):
    "A terminal's Ctrl-C reaches the whole process group: `--jobs 2`'s workers, still importing torch, print no traceback (SweepWorkers)."
    out = tmp_path / "sweep"
    p = subprocess.Popen([sys.executable, "-c", "import sys; from basedirected.launch import repro; sys.exit(repro())", "--preset", "smoke", "--out", str(out),
                          "--quiet", "--jobs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_default_sigint)
    _wait_until(lambda: (out / "preset.json").exists(), p)
    time.sleep(after)  # the workers are spawned as the bases are prepared, and import torch for a second or two
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_ctrl_c_as_a_finished_command_exits_changes_nothing(tmp_path):
    "Once the entry point returns, the interpreter's exit (here an atexit handler standing for a pool's threads being joined) ignores Ctrl-C."
    (tmp_path / "slow_exit.py").write_text("import atexit, time\ndef main():\n    atexit.register(time.sleep, 3)\n    print('done', flush=True)\n    return 0\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from basedirected.launch import command; sys.exit(command('basedirected-x', 'slow_exit:main')())"
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    assert p.stdout.readline().strip() == "done"
    time.sleep(0.5); p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err == "", err


# --- reliability round 5: a run directory is data, every overflow refused up front, errors in one line -------------------

T5 = ["--n-train", "600", "--n-eval", "32", "--base-steps", "30", "--d-model", "16", "--n-layers", "1", "--c-samples", "16", "--batch-size", "8",
      "--steps", "5", "--quiet", "--device", "cpu", "--allow-failed-base", "--no-metrics"]


def _cli_t5(tmp_path, capsys, *extra):
    "Exit status and stderr lines of `basedirected-train` on a tiny sorting run; the run directory's files afterwards."
    d = tmp_path / "run"
    try: code = train_main(["--run-dir", str(d), *T5, *extra])
    except SystemExit as e: code = e.code
    return code, capsys.readouterr().err.strip().splitlines(), sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_load_run_runs_no_function_a_run_directory_names(tmp_path):
    "A config.json naming 'shutil:rmtree' as its loader deletes nothing: only the package's loaders run."
    rd = tmp_path / "run"
    prepare_run(rd, tiny(), device="cpu")
    record = json.loads((rd / "config.json").read_text()); record["loader"] = "shutil:rmtree"
    (rd / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="names the loader 'shutil:rmtree', which is not one of the package's"): load_run(rd)
    assert (rd / "base.pt").is_file()


@pytest.mark.parametrize("extra, named", [(["--code-init-noise", "1e30"], "--code-init-noise must be <= 1000"), (["--coupling", "1e308"], "--coupling must be <= 1e+06"),
                                          (["--lambda-dist", "1e308"], "--lambda-dist must be <= 1e+06"), (["--lambda-tok", "1e308"], "--lambda-tok must be <= 1e+06"),
                                          (["--lambda-dist", "1e39", "--beta", "0.1"], "--lambda-dist must be <= 1e+06"), (["--lr", "1e30"], "--lr must be <= 10"),
                                          (["--lambda-dist", "1e30"], "--lambda-dist must be <= 1e+06"), (["--gamma", "1e39"], "--gamma must be <= 1000")])
def test_a_value_from_which_the_loss_cannot_be_finite_is_refused_up_front_by_name(tmp_path, capsys, extra, named):
    code, err, files = _cli_t5(tmp_path, capsys, *extra)
    assert code == 2 and len(err) == 1 and named in err[0] and files == [], (err, files)


def test_a_run_whose_every_step_is_skipped_fails(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, range(100))  # every step's token losses non-finite
    code = cli(tmp_path / "run", "--steps", "5", "--max-nonfinite-steps", "10", capsys=capsys)
    assert code[0] == 2 and "every one of its 5 steps was skipped" in code[1] and not (tmp_path / "run" / "eval.json").exists()


@pytest.mark.parametrize("extra, named", [(["--code-init-noise", "0.5", "--latent", "continuous"], "a continuous --latent has none"),
                                          (["--coupling", "1", "--beta", "0"], "with a KL weight of 0 the term does nothing"),
                                          (["--coupling-reader", "bag"], "--coupling-reader is the coupling term's classifier"),
                                          (["--objective", "celbo", "--alpha", "0.2"], "--alpha 0.2 has no effect on objective celbo")])
def test_an_option_that_would_do_nothing_is_refused(tmp_path, capsys, extra, named):
    code, err, files = _cli_t5(tmp_path, capsys, *extra)
    assert code == 2 and len(err) == 1 and named in err[0] and files == [], (err, files)


def test_under_torchrun_a_batch_that_does_not_split_is_refused_before_any_rank_writes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3"); monkeypatch.setenv("RANK", "0")
    code, err, files = _cli_t5(tmp_path, capsys)
    assert code == 2 and "--batch-size 8: batch size 8 must be divisible by the 3 processes" in err[-1] and files == []


@pytest.mark.parametrize("overrides, named", [({"train.steps": 1.5}, "train.steps must be an integer"), ({"train.steps": True}, "train.steps must be an integer"),
                                              ({"cvae.K": 3.5}, "cvae.K must be an integer"), ({"train.batch_size": 8.0}, "train.batch_size must be an integer"),
                                              ({"train.grad_accum": 2.0}, "train.grad_accum must be an integer"), ({"train.lr": "0.1"}, "train.lr must be a number"),
                                              ({"train..steps": 3}, "train.(empty): TrainConfig has no field ''"), ({"train.beta": 0.1}, "train.beta is a group of fields"),
                                              ({"train.tau": 0.1, "train.beta.beta": 0.2}, "both set the KL weight"), ({"trian.steps": 3}, "has no field 'trian'")])
def test_the_api_refuses_a_value_of_the_wrong_type_or_path_by_name(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)): resolve_config("sorting", overrides=overrides)


def test_the_api_names_an_unknown_objective_and_an_alpha_it_ignores():
    with pytest.raises(ValueError, match="objective must be one of .*, got 'bogus'"): resolve_config("sorting", "bogus")
    with pytest.raises(ValueError, match="alpha 0.2 has no effect on objective celbo"): resolve_config("sorting", "celbo", alpha=0.2)


def test_load_run_checks_what_a_resume_checks(tmp_path):
    rd = tmp_path / "run"
    prepare_run(rd, tiny(), device="cpu")
    scale = json.loads((rd / "reference_scale.json").read_text())
    for bad in (float("nan"), -1.0):
        damaged = {**scale, "model": {**scale["model"], "value": bad}}
        (rd / "reference_scale.json").write_text(json.dumps(damaged).replace("NaN", "NaN"))
        with pytest.raises(ValueError, match="reference_scale.json: the model estimate of c_theta is .* not a positive number"): load_run(rd)
    (rd / "reference_scale.json").write_text(json.dumps(scale))
    good = (rd / "config.json").read_text()
    (rd / "config.json").write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match="config.json is not valid JSON"): load_run(rd)
    record = json.loads(good); del record["config"]["train"]
    (rd / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="holds no configuration this package can rebuild"): load_run(rd)


def test_load_run_names_a_checkpoint_of_other_shapes(tmp_path):
    rd = tmp_path / "run"
    run(rd, tiny(), device="cpu", stop_after=4)
    record = json.loads((rd / "config.json").read_text()); record["config"]["cvae"]["K"] = 4
    (rd / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="checkpoint.pt holds (other trained weights|weights of other shapes) than this configuration trains"): load_run(rd)


def test_a_gate_record_edited_to_pass_is_refused(tmp_path, capsys):
    from basedirected.base import gate_failures
    d = tmp_path / "run"
    assert train_main(["--run-dir", str(d), *TINY]) == 0
    gate = json.loads((d / "base_gate.json").read_text()); assert gate_failures(gate)  # the tiny base fails its gate
    gate["passes"] = True; (d / "base_gate.json").write_text(json.dumps(gate))
    code, message = cli(d, "--steps", "9", "--force", capsys=capsys)
    assert code == 0  # --force measures it again
    gate["passes"] = True; (d / "base_gate.json").write_text(json.dumps(gate))
    code, message = cli(d, "--steps", "9", capsys=capsys)
    assert code == 2 and "base_gate.json says the base passes the gate, but its figures say it fails" in message


def test_placing_packs_refuses_what_it_cannot_place():
    from basedirected.experiments import DevicePlacer, pack_memory_gib, run_placed
    with pytest.raises(ValueError, match="jobs must be an integer >= 1"): list(run_placed([1.0], DevicePlacer([8.0]), None, 0))
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="positive, finite memory estimate"): list(run_placed([bad], DevicePlacer([8.0]), None, 1))
    with pytest.raises(ValueError, match="a pack holds at least one run"): pack_memory_gib([])


def test_a_group_names_why_a_run_trains_alone():
    from basedirected.groups import RunGroup
    import dataclasses as dc
    from basedirected.cvae import CVAEConfig
    class FakeRun:  # what RunGroup reads before anything else: the configuration
        def __init__(self, config): self.config, self.device = config, torch.device("cpu")
    for cvae, why in ((CVAEConfig(K=3, coupling=1.0), "the coupling term is not stacked"), (CVAEConfig(K=3, router="marginal"), "a marginal router r(z) is not stacked")):
        with pytest.raises(ValueError, match=re.escape(why)): RunGroup([FakeRun(dc.replace(tiny(), cvae=cvae))])


def test_strategy_information_refuses_float_strategies():
    from basedirected.metrics import strategy_information
    with pytest.raises(ValueError, match="strategies must be integer labels"): strategy_information(torch.full((4, 3), 1 / 3), torch.tensor([0.0, 1.0, 2.0, 0.0]))


def test_a_users_ctrl_c_while_the_command_loads_is_one_line(tmp_path):
    (tmp_path / "slow_import.py").write_text("raise KeyboardInterrupt\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from basedirected.launch import command; command('basedirected-x', 'slow_import:main')()"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 130 and p.stderr.strip() == "basedirected-x: interrupted while loading"


def _repro(argv, capsys):
    from basedirected.repro import repro_main
    try: code = repro_main(argv)
    except SystemExit as e: code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def test_repro_refuses_a_pattern_that_overflows_and_an_earlier_collection_it_cannot_read(tmp_path, capsys):
    code, err = _repro(["--preset", "smoke", "--out", str(tmp_path / "o"), "--only", "a{99999999999}"], capsys)
    assert code == 2 and len(err) == 1 and "--only 'a{99999999999}' is not a regular expression this package can use" in err[0]
    earlier = tmp_path / "earlier"; earlier.mkdir()
    (earlier / "results.csv").write_text("key,rate\nx,1\n")
    code, err = _repro(["--preset", "smoke", "--out", str(tmp_path / "o"), "--earlier", str(earlier)], capsys)
    assert code == 2 and len(err) == 1 and "no base_gates.json there" in err[0]
    (earlier / "base_gates.json").write_text("{}"); (earlier / "results.csv").write_text("rate\n1\n")
    code, err = _repro(["--preset", "smoke", "--out", str(tmp_path / "o"), "--earlier", str(earlier)], capsys)
    assert code == 2 and len(err) == 1 and "results.csv has no column 'key'" in err[0]
    (earlier / "results.csv").write_bytes(b"key\n\xff\xfe\n")
    code, err = _repro(["--preset", "smoke", "--out", str(tmp_path / "o"), "--earlier", str(earlier)], capsys)
    assert code == 2 and len(err) == 1 and "results.csv is not UTF-8 text" in err[0]
    assert not (tmp_path / "o" / "runs").exists()  # refused before any cell trained


def test_repro_collect_on_a_full_disk_is_one_line(smoke_dir, tmp_path, capsys, monkeypatch):
    import shutil
    import basedirected.reports as reports
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)
    def full(path, data): raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(reports, "atomic_write_bytes", full)
    code, err = _repro(["--collect", "--out", str(out), "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and "No space left on device; the finished cells are kept" in err[0]


def test_bases_with_a_gate_record_edited_to_pass_are_refused(smoke_dir, tmp_path, capsys):
    import shutil
    bases = tmp_path / "bases"; shutil.copytree(smoke_dir / "bases", bases)
    gate_file = next(bases.glob("*/base_gate.json"))
    gate = json.loads(gate_file.read_text()); gate["passes"] = not gate["passes"]; gate_file.write_text(json.dumps(gate))
    code, err = _repro(["--preset", "smoke", "--out", str(tmp_path / "o"), "--bases", str(bases), "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and "the record was changed" in err[0] and str(gate_file) in err[0]


def test_a_full_disk_under_tensorboard_is_one_warning_and_the_run_completes(tmp_path, capsys):
    "The events are a view of log.jsonl: a disk that fills under them stops the events with one line, never the run or its record."
    pytest.importorskip("tensorboard")
    d = tmp_path / "small"
    _mount_tmpfs(d, "16k")
    try:
        code, _ = cli(tmp_path / "run", "--steps", "40", "--eval-every", "5", "--tensorboard", str(d / "tb"), capsys=None)
        err = capsys.readouterr().err
        assert code == 0 and "Traceback" not in err and "Exception in thread" not in err, err[-2000:]
        warned = [l for l in err.splitlines() if "--tensorboard" in l]
        assert len(warned) == 1 and "No space left on device; its events stop (none after step" in warned[0], warned
        assert len([r for r in read_log(tmp_path / "run" / "log.jsonl") if r["split"] == "train"]) == 40  # every step's record
    finally:
        subprocess.run(["umount", str(d)])
