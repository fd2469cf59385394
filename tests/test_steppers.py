"""The faults every way of training survives, stepper by stepper: one run alone (`OneRun`), one run over two processes under
torchrun (`ShardedRun`, gloo), and a group of two runs (`RunGroup`). `fit` owns resume, checkpoints, logs and the non-finite guard
once; these tests hold each stepper to it. Every run trains in a subprocess through one small entry script, so that a kill -9 is a
real kill and a poisoned step is poisoned in the process that trains."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from basedirected.runs import load_run, read_log

STEPPERS = ("one", "sharded", "group")
TINY = ["--task", "visiting_order", "--n-train", "600", "--n-eval", "32", "--c-samples", "64", "--base-steps", "40", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--d-ff", "64", "--K", "3", "--posterior", "exact", "--steps", "8", "--batch-size", "8", "--eval-every", "4", "--checkpoint-every", "4",
        "--threads", "1", "--quiet", "--allow-failed-base"]

ENTRY = r'''
import os, sys
poisoned = {int(s) for s in os.environ.get("POISON_STEPS", "").split(",") if s}
mode, run_dir, *argv = sys.argv[1:]
if os.environ.get("STEP_SLEEP"):  # slow each step down, so that a kill lands between two checkpoints, never between a group's runs
    import time, basedirected.train as train, basedirected.groups as groups
    for cls in (train.OneRun, groups.RunGroup):
        def slowed(self, step, _step=cls.step): time.sleep(float(os.environ["STEP_SLEEP"])); return _step(self, step)
        cls.step = slowed
if poisoned and mode != "group":  # the CVAE's token losses are NaN at these 0-based training forwards of this process
    import basedirected.cvae as cvae
    real, seen = cvae.cvae_forward, {"calls": 0}
    def forward(model, exs, generator=None, eps=None):
        out = real(model, exs, generator, eps)
        if model.training:
            if seen["calls"] in poisoned:  # the exact posterior fills nll in from the per-code losses later
                if out.nll is None: out.nll_per_code = out.nll_per_code * float("nan")
                else: out.nll = out.nll * float("nan")
            seen["calls"] += 1
        return out
    cvae.cvae_forward = forward
if poisoned and mode == "group":  # run 1's copy of the stacked weights is NaN at these 0-based group steps
    import basedirected.groups as groups
    real_copy, seen = groups.compute_copy, {"calls": 0}
    def compute_copy(params, dtype):
        out = dict(real_copy(params, dtype))
        if seen["calls"] in poisoned:
            name = next(iter(out)); out[name] = out[name].clone(); out[name][1] = float("nan")
        seen["calls"] += 1
        return out
    groups.compute_copy = compute_copy
if mode != "group":
    from basedirected.cli import train_main
    sys.exit(train_main(["--run-dir", run_dir, *argv]))
# a group of two runs (CVAE seeds 0 and 1 on one base), as a sweep trains them
from basedirected.cli import _safe_force
from basedirected.config import build_parser, config_from_args
from basedirected.groups import train_group
from basedirected.runs import RunDir, prepare_run
stop_after = int(argv[argv.index("--stop-after") + 1]) if "--stop-after" in argv else None
argv = [a for i, a in enumerate(argv) if a != "--force" and a != "--stop-after" and (i == 0 or argv[i - 1] != "--stop-after")]
try:
    configs = [config_from_args(build_parser().parse_args([*argv, "--seed", str(s), "--base-seed", "0"])) for s in (0, 1)]
    if "--force" in sys.argv: [_safe_force(RunDir(f"{run_dir}/s{s}")) for s in (0, 1)]
    runs = [prepare_run(f"{run_dir}/s{s}", c, "cpu") for s, c in zip((0, 1), configs)]
except ValueError as e: sys.exit(f"group: error: {e}")
finals = train_group(runs, stop_after=stop_after)
if any(isinstance(f, Exception) for f in finals): sys.exit(f"group: error: {next(f for f in finals if isinstance(f, Exception))}")
'''


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    p = tmp_path_factory.mktemp("entry") / "entry.py"
    p.write_text(ENTRY)
    return p


@pytest.fixture(scope="module")
def straight(entry, tmp_path_factory):
    "The uninterrupted run of the default tiny configuration under a stepper, trained once per module and only read: what the resumed runs must equal."
    done = {}
    def run(stepper):
        if stepper not in done:
            done[stepper] = tmp_path_factory.mktemp(f"straight-{stepper}") / "run"
            train(entry, stepper, done[stepper])
        return done[stepper]
    return run


def command(entry, stepper, run_dir, *extra):
    "The command that trains `run_dir` under `stepper`."
    if stepper == "sharded":
        # --standalone: the launcher binds a free port itself and keeps it (a port picked here and released could be taken before it binds)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(entry), "sharded", str(run_dir), *TINY, *extra]
    return [sys.executable, str(entry), stepper, str(run_dir), *TINY, *extra]


def train(entry, stepper, run_dir, *extra, poison=(), check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POISON_STEPS": ",".join(map(str, poison))}
    p = subprocess.run(command(entry, stepper, run_dir, *extra), env=env, capture_output=True, text=True, timeout=600)
    if check: assert p.returncode == 0, p.stderr[-3000:]
    return p


BASE_FILES = ("base.pt", "reference_scale.json", "base_gate.json")


def seed_base(stepper, run_dir, straight):
    """Give each run directory a stepper writes the base, c_theta and gate files of the uninterrupted one-process run: the same recipe's base, which a
    new run loads instead of pre-training it again. The uninterrupted runs (`straight`) pre-train their own under each stepper, and the others must equal them."""
    source = straight("one")
    for d in dirs(stepper, run_dir):
        d.mkdir(parents=True)
        for name in BASE_FILES: shutil.copy2(source / name, d / name)


def dirs(stepper, run_dir):
    "The run directories a stepper writes: one, or the group's two."
    return [run_dir / "s0", run_dir / "s1"] if stepper == "group" else [run_dir]


def records(d):
    "The log without its timings."
    return [{k: v for k, v in r.items() if k != "examples_per_s"} for r in read_log(d / "log.jsonl")]


def weights(d):
    return torch.load(d / "checkpoint.pt", weights_only=True)["model"]


def same_runs(a, b):
    assert records(a) == records(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def opened_by_load_run(d):
    "`load_run` opens what the stepper wrote: the final held-out evaluation of the loaded run is the one in eval.json."
    from basedirected.train import evaluate
    run = load_run(d)
    final = {k: v for k, v in json.loads((d / "eval.json").read_text()).items() if k != "c_ref"}
    again = evaluate(run, run.kl_weight(run.config.train.steps))
    assert again.keys() == final.keys() and all(abs(again[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in final.items())


def wait_until_unlocked(directories, timeout=60):
    "A SIGKILLed process lets go of its run directory's lock when the kernel has torn it down, which can lag its launcher's wait()."
    deadline = time.time() + timeout
    for d in directories:
        if not d.is_dir(): continue
        fd = os.open(d, os.O_RDONLY)
        try:
            while True:
                try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); fcntl.flock(fd, fcntl.LOCK_UN); break
                except BlockingIOError:
                    assert time.time() < deadline, f"{d} is still locked {timeout} s after its writers were killed"
                    time.sleep(0.05)
        finally: os.close(fd)


@pytest.mark.parametrize("stepper", STEPPERS)
def test_kill_9_then_resume_is_the_uninterrupted_run(entry, tmp_path, stepper, straight):
    long = ("--steps", "40", "--checkpoint-every", "5", "--eval-every", "20")
    for name in ("killed", "straight"): seed_base(stepper, tmp_path / name, straight)
    p = subprocess.Popen(command(entry, stepper, tmp_path / "killed", *long), env={**os.environ, "OMP_NUM_THREADS": "1", "STEP_SLEEP": "0.05"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = dirs(stepper, tmp_path / "killed")[-1] / "checkpoint.pt"  # the last run's: a group's runs have all written theirs
    deadline = time.time() + 300
    while not first.exists() and time.time() < deadline and p.poll() is None: time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL); p.wait()  # the launcher and every process it started
    assert first.exists(), "the run never wrote a checkpoint"
    wait_until_unlocked([tmp_path / "killed", *dirs(stepper, tmp_path / "killed")])  # the ranks die after the launcher is reaped
    train(entry, stepper, tmp_path / "killed", *long)
    train(entry, stepper, tmp_path / "straight", *long)
    for a, b in zip(dirs(stepper, tmp_path / "killed"), dirs(stepper, tmp_path / "straight")):
        same_runs(a, b)
        opened_by_load_run(b)


@pytest.mark.parametrize("stepper", STEPPERS)
def test_a_nan_step_is_skipped_and_never_reaches_the_weights_or_the_log(entry, tmp_path, stepper, straight):
    run = tmp_path / "run"
    seed_base(stepper, run, straight)
    train(entry, stepper, run, poison={2})
    *clean, hit = dirs(stepper, run)  # in a group only run 1 was poisoned; the other trains on
    assert [(r["step"], r["skipped"]) for r in read_log(hit / "log.jsonl") if "skipped" in r] == [(3, "nll")]
    for d in dirs(stepper, run):
        assert "NaN" not in (d / "log.jsonl").read_text() and (d / "eval.json").exists()
        assert all(torch.isfinite(v).all() for v in weights(d).values())
    for d in clean: assert not any("skipped" in r for r in read_log(d / "log.jsonl"))


@pytest.mark.parametrize("stepper", STEPPERS)
def test_a_torn_log_line_is_dropped_on_resume(entry, tmp_path, stepper, straight):
    seed_base(stepper, tmp_path / "torn", straight)
    train(entry, stepper, tmp_path / "torn", "--stop-after", "5")
    for d in dirs(stepper, tmp_path / "torn"):  # killed while writing step 6's line, after step 5's line (past the checkpoint)
        with open(d / "log.jsonl", "a") as f: f.write('{"step": 6, "split": "tr')
    train(entry, stepper, tmp_path / "torn")
    for a, b in zip(dirs(stepper, tmp_path / "torn"), dirs(stepper, straight(stepper))): same_runs(a, b)


@pytest.mark.parametrize("stepper", STEPPERS)
def test_a_resume_under_another_configuration_is_refused_and_force_starts_over(entry, tmp_path, stepper, straight):
    seed_base(stepper, tmp_path / "run", straight)
    train(entry, stepper, tmp_path / "run", "--lr", "3e-3", "--stop-after", "4")
    for d in dirs(stepper, tmp_path / "run"): (d / "notes.txt").write_text("a user's file")
    p = train(entry, stepper, tmp_path / "run", check=False)  # the default learning rate: another configuration
    assert p.returncode != 0 and "different configuration" in p.stderr, p.stderr[-2000:]
    assert all(torch.load(d / "checkpoint.pt", weights_only=True)["step"] == 4 for d in dirs(stepper, tmp_path / "run"))  # untouched
    train(entry, stepper, tmp_path / "run", "--force")
    for a, b in zip(dirs(stepper, tmp_path / "run"), dirs(stepper, straight(stepper))):
        same_runs(a, b)
        assert (a / "notes.txt").read_text() == "a user's file"  # --force deletes only what the package wrote


def test_two_processes_follow_the_one_process_run_and_resume_on_one(entry, tmp_path, straight):
    one = straight("one")
    seed_base("sharded", tmp_path / "two", straight)
    train(entry, "sharded", tmp_path / "two", "--stop-after", "4")
    assert json.loads((tmp_path / "two" / "config.json").read_text())["environment"]["world_size"] == 2
    train(entry, "one", tmp_path / "two")  # resumed on one process
    losses = lambda d: torch.tensor([r["loss"] for r in read_log(d / "log.jsonl") if r["split"] == "train"])
    # the all-reduce sums the two halves' gradients in another order than one process does: round-off, not a different run
    torch.testing.assert_close(losses(tmp_path / "two"), losses(one), rtol=1e-5, atol=1e-7)
    assert [r["step"] for r in read_log(tmp_path / "two" / "log.jsonl") if r["split"] == "train"] == list(range(1, 9))  # one writer
