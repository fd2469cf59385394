"""The sweep runner on the smoke preset: outputs, skipping finished runs, parallel runs, the main-job CLI."""
import csv
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from basedirected.experiments import PRESETS, aggregate, execute, markdown_table, objectives, plan, repro_main, write_figures


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    repro_main(["--preset", "smoke", "--out", str(out), "--quiet"])
    return out


def test_main_job_writes_tables_figures_and_per_run_files(smoke_dir):
    assert {"results.csv", "table.md", "table.csv", "summary.json", "preset.json"} <= set(os.listdir(smoke_dir))
    figures = set(os.listdir(smoke_dir / "figures"))
    for name in ("frontier-early-discrete", "training-curves", "gain-per-position", "weights-heatmap"):
        assert {f"{name}.png", f"{name}.svg"} <= figures
    for spec in plan(PRESETS["smoke"]):
        d = smoke_dir / "runs" / spec.key
        assert {"config.json", "reference_scale.json", "log.jsonl", "checkpoint.pt", "metrics.json", "eval.json"} <= set(os.listdir(d))
    rows = list(csv.DictReader(open(smoke_dir / "results.csv")))
    assert len(rows) == len(plan(PRESETS["smoke"]))
    assert {"rate", "gain_abs", "I_zs_norm", "I_zxy", "gen_valid_rate", "gen_mean_purity", "marginal_nll", "eval_theta"} <= set(rows[0])


def test_rerun_skips_finished_runs_and_force_reruns(smoke_dir):
    keys = [s.key for s in plan(PRESETS["smoke"])]
    stamp = {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}
    execute(smoke_dir, PRESETS["smoke"], progress=False)
    assert stamp == {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}


def test_interrupted_run_resumes(tmp_path):
    preset = PRESETS["smoke"]
    spec = plan(preset)[0]
    execute(tmp_path, dataclasses.replace(preset, objectives=(spec.objective,)), progress=False)
    run_dir = tmp_path / "runs" / spec.key
    (run_dir / "metrics.json").unlink()  # as if killed after training, before evaluation
    records = execute(tmp_path, dataclasses.replace(preset, objectives=(spec.objective,)), progress=False)
    assert (run_dir / "metrics.json").exists() and records[0]["key"] == spec.key


def test_parallel_runs_match_sequential_runs(tmp_path, smoke_dir):
    execute(tmp_path, PRESETS["smoke"], jobs=2, device="cpu", progress=False)
    for spec in plan(PRESETS["smoke"]):
        a = json.loads((smoke_dir / "runs" / spec.key / "eval.json").read_text())
        b = json.loads((tmp_path / "runs" / spec.key / "eval.json").read_text())
        assert a["c_ref"] == b["c_ref"]
        for k in ("theta", "std", "kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_figures_regenerate_from_files_alone(smoke_dir):
    for f in (smoke_dir / "figures").iterdir():
        f.unlink()
    write_figures(smoke_dir)
    assert (smoke_dir / "figures" / "frontier-early-discrete.png").stat().st_size > 10_000


def test_every_objective_of_the_comparison_is_distinct():
    objs = objectives(0.5, 1.0)
    assert {"celbo", "theta", "dist", "ex", "tok", "tok_cc", "inv_tok", "topk", "mean1", "celbo_warmup", "celbo_zero_linear",
            "celbo_cyclical", "celbo_free_bits"} == set(objs)
    signatures = {(o.loss, o.beta_kind, o.free_bits) for o in objs.values()}
    assert len(signatures) == len(objs)


def test_aggregate_and_markdown():
    recs = [{"regime": "early", "latent": "discrete", "objective": "theta", "alpha": 0.5, "gamma": 1.0, "beta": 0.1, "seed": s, "rate": r}
            for s, r in enumerate([0.5, 1.5, 1.0])]
    row = aggregate(recs)[0]
    assert row["rate"] == pytest.approx(1.0) and row["rate_se"] == pytest.approx(0.5 / 3**0.5)
    assert "1.000 ± 0.289" in markdown_table([row], metrics=("rate",))


def test_repro_cli_rejects_bad_options():
    p = subprocess.run([sys.executable, "-c", "from basedirected.experiments import repro_main; repro_main()", "--jobs", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--jobs must be >= 1" in p.stderr
