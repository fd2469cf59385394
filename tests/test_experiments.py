"""The sweep runner and reports on the smoke preset: outputs, skipping finished runs, configuration checks, parallel runs,
the main-job CLI, and the agreement of sweep cells with the training CLI."""
import csv
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from basedirected.experiments import PRESETS, execute, plan, run_cell
from basedirected.objective import objectives
from basedirected.reports import aggregate, markdown_table, repro_main, write_figures
from basedirected.runs import RunDir, load_run, read_log
from basedirected.train import build_parser, config_from_args, train_main


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1"])  # one process: bit-identical to a CLI run
    return out


def test_main_job_writes_tables_figures_and_per_run_files(smoke_dir):
    assert {"results.csv", "table.md", "table.csv", "summary.json", "preset.json"} <= set(os.listdir(smoke_dir))
    figures = set(os.listdir(smoke_dir / "figures"))
    for name in ("frontier-early-discrete", "training-curves", "gain-per-position", "weights-heatmap"):
        assert {f"{name}.png", f"{name}.svg"} <= figures
    for spec in plan(PRESETS["smoke"]):
        d = smoke_dir / "runs" / spec.key
        assert {"config.json", "reference_scale.json", "log.jsonl", "checkpoint.pt", "metrics.json", "eval.json", "command.txt"} <= set(os.listdir(d))
    rows = list(csv.DictReader(open(smoke_dir / "results.csv")))
    assert len(rows) == len(plan(PRESETS["smoke"]))
    assert {"rate", "gain_abs", "I_zs_norm", "I_zxy", "gen_valid_rate", "gen_mean_purity", "marginal_nll", "eval_theta"} <= set(rows[0])


def test_rerun_skips_finished_runs(smoke_dir):
    keys = [s.key for s in plan(PRESETS["smoke"])]
    stamp = {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}
    execute(smoke_dir, PRESETS["smoke"], progress=False)
    assert stamp == {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}


def test_interrupted_run_resumes(tmp_path):
    preset = dataclasses.replace(PRESETS["smoke"], posteriors=("exact",))
    spec = plan(preset)[0]
    execute(tmp_path, dataclasses.replace(preset, objectives=(spec.objective,)), progress=False)
    run_dir = tmp_path / "runs" / spec.key
    (run_dir / "metrics.json").unlink()  # as if killed after training, before evaluation
    records = execute(tmp_path, dataclasses.replace(preset, objectives=(spec.objective,)), progress=False)
    assert (run_dir / "metrics.json").exists() and records[0]["key"] == spec.key


def test_a_changed_preset_reruns_its_cells(tmp_path, capsys):
    preset = dataclasses.replace(PRESETS["smoke"], objectives=("celbo",), posteriors=("exact",))
    execute(tmp_path, preset, progress=False)
    changed = dataclasses.replace(preset, cvae_steps=preset.cvae_steps + 2)
    (record,) = execute(tmp_path, changed, progress=False)
    assert "configuration changed; rerunning" in capsys.readouterr().out
    assert load_run(tmp_path / "runs" / record["key"]).config == plan(changed)[0].config
    assert max(l["step"] for l in read_log(tmp_path / "runs" / record["key"] / "log.jsonl")) == changed.cvae_steps


def test_parallel_runs_match_sequential_runs(tmp_path, smoke_dir):
    execute(tmp_path, PRESETS["smoke"], jobs=2, device="cpu", progress=False)
    for spec in plan(PRESETS["smoke"]):
        a = json.loads((smoke_dir / "runs" / spec.key / "eval.json").read_text())
        b = json.loads((tmp_path / "runs" / spec.key / "eval.json").read_text())
        assert a["c_ref"]["value"] == pytest.approx(b["c_ref"]["value"], rel=1e-6)  # one thread per job vs two: round-off only
        for k in ("theta", "std", "kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_figures_regenerate_from_files_alone(smoke_dir):
    (smoke_dir / "runs" / "stray.txt").write_text("not a run")
    for f in (smoke_dir / "figures").iterdir():
        f.unlink()
    write_figures(smoke_dir)
    assert (smoke_dir / "figures" / "frontier-early-discrete.png").stat().st_size > 10_000


def test_every_sweep_cell_is_the_training_cli_with_its_options():
    parser = build_parser()
    for name in ("smoke", "quick"):
        for spec in plan(PRESETS[name]):
            assert config_from_args(parser.parse_args(list(spec.argv))) == spec.config
            assert spec.config.objective == spec.objective
            assert spec.config.loss == objectives(spec.alpha, spec.gamma)[spec.objective].loss
    assert {s.objective for s in plan(PRESETS["paper"])} == set(objectives())


def test_a_sweep_run_and_a_cli_run_of_the_same_objective_log_the_same_terms(tmp_path, smoke_dir):
    spec = next(s for s in plan(PRESETS["smoke"]) if s.objective == "theta")
    cli_dir = tmp_path / "cli"
    train_main(["--run-dir", str(cli_dir), "--quiet", "--allow-failed-base", *spec.argv])
    strip = lambda log: [{k: v for k, v in l.items() if k != "examples_per_s"} for l in log]
    sweep_log, cli_log = read_log(smoke_dir / "runs" / spec.key / "log.jsonl"), read_log(RunDir(cli_dir).log)
    assert [set(l) for l in sweep_log] == [set(l) for l in cli_log]
    assert strip(sweep_log) == strip(cli_log)  # same configuration, same seed: the same numbers


def test_aggregate_and_markdown():
    recs = [{"regime": "early", "latent": "discrete", "objective": "theta", "alpha": 0.5, "gamma": 1.0, "beta": 0.1, "seed": s, "rate": r}
            for s, r in enumerate([0.5, 1.5, 1.0])]
    row = aggregate(recs)[0]
    assert row["rate"] == pytest.approx(1.0) and row["rate_se"] == pytest.approx(0.5 / 3**0.5)
    assert "1.000 ± 0.289" in markdown_table([row], metrics=("rate",))


def test_repro_cli_rejects_bad_options():
    p = subprocess.run([sys.executable, "-c", "from basedirected.reports import repro_main; repro_main()", "--jobs", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--jobs must be >= 1" in p.stderr
