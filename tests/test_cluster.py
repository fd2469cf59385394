"""Sweeps through submitit without Slurm: the local cluster gives the in-process sweep's results; a job killed with kill -9 and
a job sent submitit's preemption signal both resume to the uninterrupted result; Slurm's job array is written as asked for
(a stand-in sbatch records it); bad options are refused before anything is submitted."""
import csv
import dataclasses
import json
import os
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

submitit = pytest.importorskip("submitit")

from basedirected.cluster import ClusterConfig, PackJob, collect, make_executor, submit_sweep
from basedirected.experiments import execute
from basedirected.presets import PRESETS, plan
from basedirected.repro import repro_main
from basedirected.runs import RunDir, read_json, read_log

LOCAL = ClusterConfig(executor="submitit", cluster="local", poll_s=0.05)  # a look at local jobs costs little; a long wait is idle time
# one cell long enough to be stopped between checkpoints: 500 steps, a checkpoint every 100 (the test sees the first within 0.1 s,
# with 400 steps to go)
LONG = dataclasses.replace(PRESETS["smoke"], objectives=("theta",), posteriors=("exact",), cvae_steps=500, evals=5)


def _rows(out):
    return {r["key"]: {k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(Path(out) / "results.csv"))}


def _metrics(out, key):
    return {k: v for k, v in read_json(Path(out) / "runs" / key / "metrics.json").items() if k != "seconds"}


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory):
    "LONG's cell trained in this process without a stop."
    out = tmp_path_factory.mktemp("long-reference")
    execute(out, LONG, progress=False)
    return out


def _when_checkpointed(out, key, timeout=120):
    "Wait until the cell has a checkpoint but has not finished; returns the checkpoint's step."
    rd = RunDir(Path(out) / "runs" / key)
    t0 = time.time()
    while time.time() - t0 < timeout:
        if rd.metrics.exists(): pytest.fail("the run finished before it could be stopped")
        if rd.checkpoint.exists() and rd.log.exists() and read_log(rd.log): return read_log(rd.log)[-1]["step"]
        time.sleep(0.1)
    pytest.fail("no checkpoint appeared")


def _job_processes(out):
    "Pids of the processes running a job of the sweep in `out` (submitit's `_submit` entry point)."
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit(): continue
        try: cmd = (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError: continue
        if "submitit.core._submit" in cmd and str(out) in cmd: pids.append(int(p.name))
    return pids


@pytest.fixture(scope="module")
def local_smoke(tmp_path_factory):
    "The smoke preset through the local cluster: one subprocess job per cell, two at a time on two cores."
    out = tmp_path_factory.mktemp("local-smoke")
    assert repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--executor", "submitit", "--cluster", "local", "--poll-s", "0.05"]) == 0
    return out


def test_the_local_cluster_gives_the_in_process_sweeps_results(smoke_dir, local_smoke):
    tmp_path = local_smoke
    assert _rows(tmp_path) == _rows(smoke_dir)  # every metric of every cell
    jobs = read_json(tmp_path / "jobs.json")
    assert set(jobs) == {s.key for s in plan(PRESETS["smoke"])} and all(Path(j["stderr"]).is_file() for j in jobs.values())
    assert read_json(tmp_path / "summary.json")["missing"] == []
    before = {k: os.path.getmtime(tmp_path / "runs" / k / "metrics.json") for k in jobs}
    assert repro_main(["--preset", "smoke", "--out", str(tmp_path), "--quiet", "--executor", "submitit", "--cluster", "local"]) == 0
    assert before == {k: os.path.getmtime(tmp_path / "runs" / k / "metrics.json") for k in jobs}  # nothing resubmitted


def test_a_job_killed_mid_run_resumes_when_the_command_is_rerun(long_reference, tmp_path):
    key = plan(LONG)[0].key
    report = {}
    sweep = threading.Thread(target=lambda: report.update(submit_sweep(tmp_path, LONG, LOCAL, progress=False)))
    sweep.start()
    step = _when_checkpointed(tmp_path, key)
    pids = _job_processes(tmp_path)
    assert pids, "no job process found"
    for pid in pids: os.kill(pid, signal.SIGKILL)
    sweep.join(timeout=120)
    assert not sweep.is_alive()
    assert [f["cells"] for f in report["failed"]] == [[key]] and report["missing"] == [key]
    assert step < LONG.cvae_steps and RunDir(tmp_path / "runs" / key).checkpoint.exists()
    again = submit_sweep(tmp_path, LONG, LOCAL, progress=False)  # the same command again: only the unfinished cell, from its checkpoint
    assert again["failed"] == [] and again["missing"] == []
    assert _metrics(tmp_path, key) == _metrics(long_reference, key)
    log = read_log(RunDir(tmp_path / "runs" / key).log)
    assert [r["step"] for r in log] == [r["step"] for r in read_log(RunDir(long_reference / "runs" / key).log)]


def test_a_preempted_job_checkpoints_requeues_and_resumes(long_reference, tmp_path):
    "submitit's own signal (USR2, what Slurm sends before a time limit or on preemption) reaches PackJob.checkpoint; the requeued job resumes."
    spec = plan(LONG)[0]
    ex = make_executor(LOCAL, tmp_path, LONG, "local")
    job = ex.submit(PackJob(tmp_path, LONG, [spec]))
    _when_checkpointed(tmp_path, spec.key)
    pids = _job_processes(tmp_path)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGUSR2)  # what Slurm sends the job's process on preemption, or 90 s before its time limit
    assert job.result() == [spec.key]
    log_text = Path(job.paths.stderr).read_text() + Path(job.paths.stdout).read_text()
    assert "preempted" in log_text and "Requeued" in log_text  # the handler ran and the controller started the job again
    assert _metrics(tmp_path, spec.key) == _metrics(long_reference, spec.key)


def test_collect_reports_the_missing_cells_with_their_job_logs(smoke_dir, local_smoke, tmp_path, capsys):
    out = tmp_path / "partial"
    shutil.copytree(local_smoke, out)
    gone = plan(PRESETS["smoke"])[1].key
    (out / "runs" / gone / "metrics.json").unlink()
    capsys.readouterr()
    assert repro_main(["--collect", "--out", str(out), "--quiet"]) == 1
    printed = capsys.readouterr().out
    assert f"1 cells missing:\n  {gone} (job " in printed and read_json(out / "jobs.json")[gone]["stderr"] in printed
    rows = _rows(out)
    assert set(rows) == {s.key for s in plan(PRESETS["smoke"])} - {gone}
    assert all(rows[k] == _rows(smoke_dir)[k] for k in rows)
    assert read_json(out / "summary.json")["missing"] == [gone]
    records, missing = collect(out)
    assert missing == [gone] and len(records) == 3


def test_slurm_gets_one_job_array_with_the_requested_resources(tmp_path, monkeypatch):
    "A stand-in sbatch on the PATH records the script submitit writes for Slurm (srun is only looked for)."
    bin_dir = tmp_path / "bin"; bin_dir.mkdir()
    for name, script in (("sbatch", f"cp \"$1\" {tmp_path}/submitted.sh\necho 'Submitted batch job 4242'"), ("srun", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = ClusterConfig(executor="submitit", cluster="auto", slurm_partition="gpu", timeout_min=30, mem_gb=4, array_parallelism=2, no_wait=True)
    report = submit_sweep(tmp_path / "sweep", PRESETS["smoke"], cfg, progress=False)
    assert report["cluster"] == "slurm" and report["submitted"] == 4 and len(report["missing"]) == 4
    script = (tmp_path / "submitted.sh").read_text()
    for line in ("#SBATCH --array=0-3%2", "#SBATCH --partition=gpu", "#SBATCH --time=30", "#SBATCH --signal=USR2@90",
                 "#SBATCH --cpus-per-task=1", "#SBATCH --mem=4GB", "#SBATCH --job-name=basedirected-smoke"):
        assert line in script, line
    jobs = read_json(tmp_path / "sweep" / "jobs.json")
    assert sorted(j["job_id"] for j in jobs.values()) == [f"4242_{i}" for i in range(4)]


@pytest.mark.parametrize("argv, message", [
    (["--executor", "submitit", "--timeout-min", "-5"], "--timeout-min must be a finite number > 0, got -5"),
    (["--executor", "submitit", "--slurm-partition", "gpu;rm"], "--slurm-partition must be partition names"),
    (["--executor", "submitit", "--cluster", "local", "--gpus-per-job", "1"], "has no GPU torch can use"),
    (["--executor", "submitit", "--cluster", "local", "--no-wait"], "--no-wait needs a scheduler"),
    (["--executor", "submitit", "--cluster", "slurm"], "sbatch and srun are not on the PATH"),
    (["--executor", "submitit", "--jobs", "2"], "--jobs is an option of --executor pool"),
    (["--slurm-partition", "gpu"], "--slurm-partition is an option of --executor submitit"),
    (["--collect"], "--collect needs --out"),
])
def test_bad_cluster_options_are_refused_before_anything_is_submitted(argv, message, tmp_path, capsys, monkeypatch):
    if "has no GPU" in message and __import__("torch").cuda.is_available(): pytest.skip("this machine has a GPU")
    if "srun" in message: monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm here
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e: repro_main(["--preset", "smoke", "--quiet", *argv] + ([] if "--collect" in argv else ["--out", str(out)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)
    assert not (out / "jobs").exists() and not (out / "jobs.json").exists()


def test_collect_refuses_a_directory_that_is_not_a_sweep(tmp_path, capsys):
    with pytest.raises(SystemExit) as e: repro_main(["--collect", "--out", str(tmp_path)])
    assert e.value.code == 2 and "is not a sweep directory" in capsys.readouterr().err
