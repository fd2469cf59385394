"""The benchmark script runs end to end (its figures are printed, never asserted: timing belongs in benchmarks, not tests)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_throughput_benchmark_runs_and_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_throughput.py"), "--steps", "1", "--device", "cpu", "--sizes", "quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    figures = json.loads(out.read_text())
    rows = figures["rows"]
    assert {(r["size"], r["posterior"]) for r in rows} == {("quick", q) for q in ("exact", "amortized")}  # the paper size runs the same code
    assert all(r["ms_per_step"] > 0 and r["examples_per_s"] > 0 for r in rows)
    groups = figures["groups"]
    assert {(g["size"], g["runs"]) for g in groups} == {("quick", n) for n in (1, 4)}
    assert all(g["run_steps_per_min"] > 0 for g in groups)


def test_base_recipe_script_writes_the_gate_and_the_learning_curve(tmp_path):
    out = tmp_path / "recipe.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_recipe.py"), "--task", "grid_pathfinding", "--grammar", "cell+distance",
                        "--base-steps", "12", "--every", "6", "--n-train", "200", "--n-eval", "16", "--gate-inputs", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    figures = json.loads(out.read_text())
    assert [c["step"] for c in figures["curve"]] == [6, 12] and all(c["leak"] > 0 for c in figures["curve"])
    assert set(figures["gate"]) == {"held_out", "train"} and all(g["n_inputs"] == 8 for g in figures["gate"].values())
    assert figures["grammar"] == "cell+distance" and figures["base"]["steps"] == 12
    assert "," in p.stdout.splitlines()[0]  # the response names cells as one token each ("3,2")
    by_reason = figures["excess_by_move_reason"]  # every move token of every trace is counted under one reason
    assert {"preferred", "other"} <= set(by_reason) <= {"preferred", "walled", "aligned", "other"}
    assert abs(sum(v["share_of_moves"] for r, v in by_reason.items() if r != "other") - 1) < 1e-9 and by_reason["other"]["share_of_moves"] is None
    assert figures["base"]["override_fraction"] == 0.5 and figures["base"]["input_overrides"] == {"n_walls": 8}  # the task's recipe


def test_code_labellings_recomputes_each_runs_posterior_and_counts_every_held_out_pair(smoke_dir, tmp_path):
    runs = [d for d in sorted((smoke_dir / "runs").iterdir()) if (d / "metrics.json").exists() and json.loads((d / "metrics.json").read_text()).get("latent") == "discrete"]
    assert runs, "the smoke preset has a finished discrete run"
    out = tmp_path / "labellings.csv"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_labellings.py"), *map(str, runs), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import csv
    rows = list(csv.DictReader(open(out)))
    for d in runs:
        metrics, config = json.loads((d / "metrics.json").read_text()), json.loads((d / "config.json").read_text())["config"]
        mine = [r for r in rows if r["key"] == metrics["key"]]
        assert sum(int(r["n"]) for r in mine) == config["n_eval"]  # every held-out pair gets one code
        assert {r["alignment_posterior_recomputed"] for r in mine} == {r["alignment_posterior_recorded"] for r in mine}  # the posterior is the run's own
        assert {int(r["code"]) for r in mine} <= set(range(metrics["K"]))


def test_fine_tuned_base_script_writes_the_gate_and_its_time(tmp_path):
    out = tmp_path / "fine_tuned.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fine_tuned_base.py"), "--n-train", "64", "--n-eval", "8", "--steps", "3", "--batch-size", "8",
                        "--width", "16", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    figures = json.loads(out.read_text())
    assert figures["steps"] == 3 and figures["seconds"] > 0 and figures["gate"]["n_inputs"] == 8
    assert set(figures["gate"]) >= {"answer_only_accuracy", "valid_rate", "strategy_gap", "surprisal_excess", "passes"}
    assert "gate:" in p.stdout


def test_base_profiles_script_gives_the_committed_profile_of_a_shipped_base(tmp_path):
    "One shipped base's profile again, as reference/base-profiles/ holds it (to round-off: the figures are means over a few thousand tokens)."
    import csv
    out = tmp_path / "profiles.csv"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_profiles.py"), "--bases", "sorting-s0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (row,) = list(csv.DictReader(open(out)))
    committed = next(r for r in csv.DictReader(open(ROOT / "reference" / "base-profiles" / "profiles.csv")) if r["base"] == "sorting-s0")
    assert row["tokens"] == committed["tokens"] and row["task"] == committed["task"] == "sorting"
    for k in ("b_mean", "b_cv", "b_top10_share"): assert abs(float(row[k]) - float(committed[k])) <= 1e-5 * abs(float(committed[k])), k
    assert "sorting-s0" in p.stdout and "top-10 % share" in p.stdout


def test_sampling_benchmark_times_both_ways_on_the_same_draw():
    "In-process, tiny: it samples both ways and prints both timings and their ratio."
    import contextlib, io
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sampling
    finally: sys.path.pop(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out): sampling.main(["--rows", "2", "--tokens", "6", "--repeats", "1"])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("cached") and lines[1].startswith("full pass") and "full pass / cached:" in lines[2] and "12 tokens in 2 rows" in lines[0]
