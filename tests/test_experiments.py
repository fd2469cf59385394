"""The sweep runner and reports on the smoke preset: outputs, skipping finished runs, configuration checks, parallel runs,
the main-job CLI, and the agreement of sweep cells with the training CLI."""
import csv
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from basedirected.experiments import execute, run_cell

from basedirected.presets import PRESETS, plan
from basedirected.objective import objectives
from basedirected.reports import aggregate, markdown_table, write_figures
from basedirected.repro import repro_main
from basedirected.runs import RunDir, load_run, read_log
from basedirected.cli import train_main
from basedirected.config import build_parser, config_from_args


def test_main_job_writes_tables_figures_and_per_run_files(smoke_dir):
    assert {"results.csv", "table.md", "table.csv", "summary.json", "preset.json"} <= set(os.listdir(smoke_dir))
    figures = set(os.listdir(smoke_dir / "figures"))
    for name in ("frontier-early-discrete", "alignment-early-discrete", "training-curves", "gain-per-position-early", "weights-heatmap"):
        assert {f"{name}.png", f"{name}.svg"} <= figures
    for spec in plan(PRESETS["smoke"]):
        d = smoke_dir / "runs" / spec.key
        assert {"config.json", "reference_scale.json", "log.jsonl", "checkpoint.pt", "metrics.json", "eval.json", "command.txt"} <= set(os.listdir(d))
    rows = list(csv.DictReader(open(smoke_dir / "results.csv")))
    assert len(rows) == len(plan(PRESETS["smoke"]))
    assert {"rate", "gain_abs", "I_zs_norm", "I_zxy", "gen_valid_rate", "gen_mean_purity", "marginal_nll", "eval_theta"} <= set(rows[0])
    # provenance: each cell's revision and CPU in results.csv, and every revision the collection was made at in summary.json
    summary = json.loads((smoke_dir / "summary.json").read_text())
    assert {"git_revision", "git_dirty", "cpu"} <= set(rows[0]) and summary["revisions"] == sorted({r["git_revision"] for r in rows if r["git_revision"]})
    assert summary["cpus"] == sorted({r["cpu"] for r in rows}) and summary["runs_without_revision"] == sum(not r["git_revision"] for r in rows)


def test_rerun_skips_finished_runs(smoke_dir):
    keys = [s.key for s in plan(PRESETS["smoke"])]
    stamp = {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}
    execute(smoke_dir, PRESETS["smoke"], progress=False)
    assert stamp == {k: os.path.getmtime(smoke_dir / "runs" / k / "metrics.json") for k in keys}


def test_the_sweep_says_its_plan_first_and_what_it_trained_last(smoke_dir, tmp_path, capsys):
    "The plan names the cells finished and to train and an estimate before any cell trains; a rerun that trains nothing says so at the end."
    from basedirected.repro import repro_main, sweep_plan
    n = len(plan(PRESETS["smoke"]))
    fresh = sweep_plan(tmp_path / "new", PRESETS["smoke"], jobs=2)
    assert (fresh["cells"], fresh["to_train"], fresh["finished"]) == (n, n, 0) and fresh["bases"] >= 1 and fresh["seconds"] > 0
    done = sweep_plan(smoke_dir, PRESETS["smoke"], jobs=2)
    assert (done["to_train"], done["finished"], done["seconds"]) == (0, n, 0)
    assert sweep_plan(smoke_dir, PRESETS["smoke"], jobs=2, force=True)["to_train"] == n
    only = plan(PRESETS["smoke"])[0].key
    assert sweep_plan(tmp_path / "new", PRESETS["smoke"], only=f"^{only}$")["to_train"] == 1
    copy = tmp_path / "copy"; shutil.copytree(smoke_dir, copy)  # the session's sweep stays as the other tests read it
    capsys.readouterr()
    assert repro_main(["--preset", "smoke", "--out", str(copy), "--quiet", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"plan: the {n} cells of preset smoke: {n} finished, 0 to train" and "estimated" not in out
    assert f"{n} runs (every one finished before this command: none trained now) in" in out


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


def test_figures_regenerate_from_files_alone(smoke_dir, tmp_path):
    out = tmp_path / "sweep"; shutil.copytree(smoke_dir, out)  # the session's sweep is shared by the workers: only read
    (out / "runs" / "stray.txt").write_text("not a run")
    for f in (out / "figures").iterdir():
        f.unlink()
    write_figures(out)
    assert (out / "figures" / "frontier-early-discrete.png").stat().st_size > 10_000


def test_every_sweep_cell_is_the_training_cli_with_its_options():
    parser = build_parser()
    for name in ("smoke", "quick"):
        for spec in plan(PRESETS[name]):
            assert config_from_args(parser.parse_args(list(spec.argv))) == spec.config
            assert spec.config.objective == spec.objective
            assert spec.config.loss == objectives(spec.alpha, spec.gamma)[spec.objective].loss
    # every preset's cells: tests/test_config.py; every objective stays reachable from the training CLI
    for name in objectives(): assert config_from_args(parser.parse_args(["--objective", name])).objective == name


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
    p = subprocess.run([sys.executable, "-c", "from basedirected.repro import repro_main; repro_main()", "--jobs", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--jobs must be >= 1" in p.stderr


def test_a_sweep_cell_rerun_from_its_command_equals_the_sweeps_record(tmp_path, smoke_dir):
    "command.txt carries every setting that changes a figure (generation sizes, threads, base seed): run in a fresh directory it gives the same record."
    import shlex
    from basedirected.runs import read_json
    spec = next(s for s in plan(PRESETS["smoke"]) if s.objective == "theta" and s.posterior == "exact")
    argv = shlex.split((smoke_dir / "runs" / spec.key / "command.txt").read_text())
    assert argv[:3] == ["basedirected-train", "--run-dir", str(smoke_dir / "runs" / spec.key)] and "--threads" in argv and "--n-routed" in argv
    fresh = tmp_path / "fresh"
    before = __import__("torch").get_num_threads()
    try: train_main(["--run-dir", str(fresh), "--quiet", "--allow-failed-base", *argv[3:]])
    finally: __import__("torch").set_num_threads(before)
    sweep, cli = read_json(smoke_dir / "runs" / spec.key / "metrics.json"), read_json(fresh / "metrics.json")
    from basedirected.config import coordinate_record
    cell_only = {"key", "objective", "seed", "regime", "latent", "posterior", "K", "alpha", "gamma", "seconds", "tau_target", "beta_target", *coordinate_record(spec.config)}
    assert {k: v for k, v in sweep.items() if k not in cell_only} == {k: v for k, v in cli.items() if k not in cell_only}


def test_a_sweep_refuses_a_base_that_fails_the_gate_unless_the_preset_names_it(tmp_path):
    from basedirected.train import BaseGateError
    preset = dataclasses.replace(PRESETS["smoke"], gate_exceptions=(), posteriors=("exact",), objectives=("celbo",))
    with pytest.raises(BaseGateError, match="fails the quality gate .*names no exception"):
        execute(tmp_path / "a", preset, progress=False)
    assert not (tmp_path / "a" / "runs").exists()
    with pytest.raises(BaseGateError, match="names no exception"):
        execute(tmp_path / "b", preset, jobs=2, device="cpu", progress=False)  # the worker path checks it too


def test_cvae_seeds_of_a_preset_with_a_base_seed_share_one_base(tmp_path):
    preset = dataclasses.replace(PRESETS["smoke"], seeds=(0, 1), base_seed=0, posteriors=("exact",), objectives=("theta",))
    records = execute(tmp_path, preset, progress=False)
    assert sorted(os.listdir(tmp_path / "bases")) == ["early-s0"]
    assert records[0]["c_model"] == records[1]["c_model"] and records[0]["eval_loss"] != records[1]["eval_loss"]
    assert {r["base_seed"] for r in records} == {0}


def test_presets_train_each_tasks_own_recipe_and_cells_name_tau():
    study, paper = plan(PRESETS["study"]), plan(PRESETS["paper"])
    assert {s.regime for s in study} == {"sorting", "grid_pathfinding"} and {s.regime for s in paper} == {"sorting", "grid_pathfinding", "addition"}
    assert all(s.config.base.steps == {"sorting": 5000, "grid_pathfinding": 10000, "addition": 8000}[s.regime] for s in study + paper)
    tau_cells = [s for s in study if s.tau is not None]
    assert tau_cells and all(s.config.train.tau == s.tau and "--tau" in s.argv for s in tau_cells)
    assert {s.config.data_seed for s in study} == {0}


def test_paired_statistics_recover_a_known_effect_and_holm_corrects_across_tasks():
    import random
    from basedirected.reports import holm, paired_statistics, success_counts
    rng = random.Random(1)
    records = []
    for task, effect in (("sorting", 0.25), ("grid_pathfinding", 0.0), ("addition", 0.0)):
        for seed in range(8):
            shared = rng.gauss(0.3, 0.2)
            for obj, shift in (("theta", effect), ("dist", 0.0)):
                records.append({"regime": task, "latent": "discrete", "posterior": "exact", "K": 3, "objective": obj, "seed": seed, "tau_target": 0.07,
                                "gen_alignment_controlled_all_excess": shared + shift + rng.gauss(0, 0.04),
                                "gen_alignment_controlled_all": 0.95 if obj == "theta" else 0.5, "gen_answer_rate": 0.99})
    rows = {r["regime"]: r for r in paired_statistics(records, metrics=("gen_alignment_controlled_all_excess",))}
    assert rows["sorting"]["ci_lo"] > 0.15 and rows["sorting"]["ci_hi"] < 0.35 and rows["sorting"]["n"] == 8
    assert rows["grid_pathfinding"]["ci_lo"] < 0 < rows["grid_pathfinding"]["ci_hi"]
    ps = [rows[t]["p"] for t in ("sorting", "grid_pathfinding", "addition")]
    assert [rows[t]["p_holm"] for t in ("sorting", "grid_pathfinding", "addition")] == pytest.approx(holm(ps))
    assert rows["sorting"]["p_holm"] == pytest.approx(3 * rows["sorting"]["p"])
    success = {(s["regime"], s["objective"]): s for s in success_counts(records)}
    assert success[("sorting", "theta")]["success"] == 1.0 and success[("sorting", "dist")]["success"] == 0.0
    assert success[("sorting", "dist")]["success_hi"] < 0.4  # 0 of 8: the Wilson interval's upper end


def test_a_sweep_gives_the_caller_its_thread_count_back(smoke_dir, tmp_path):
    import torch
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        execute(tmp_path / "sweep", dataclasses.replace(PRESETS["smoke"], threads=1), progress=False)
        assert torch.get_num_threads() == 2
    finally: torch.set_num_threads(before)


def test_a_sweep_of_tau_and_beta_cells_reads_back_and_draws_every_figure(smoke_dir, tmp_path):
    "results.csv of a sweep mixing tau and beta cells has empty target cells; they read back as None, and the paired figure and tables use them."
    from basedirected.reports import figure_paired, read_results, write_results
    records = [json.loads(f.read_text()) for f in sorted((smoke_dir / "runs").glob("*/metrics.json"))]
    as_tau = [{**r, "key": r["key"] + "-tau", "tau_target": 0.5, "beta_target": None} for r in records]
    write_results(tmp_path, records + as_tau)
    rows = read_results(tmp_path)
    assert {r["tau_target"] for r in rows} == {None, 0.5} and {r["beta_target"] for r in rows} == {None, 0.1}
    assert figure_paired(tmp_path, "early") is not None
    assert "tau 0.5" in (tmp_path / "stats.md").read_text() and "beta 0.1" in (tmp_path / "stats.md").read_text()


def test_the_paper_preset_on_one_gpu_never_plans_past_its_memory():
    "With a fake H200 budget on the CPU: the paper preset's 64-run groups start only where their memory estimate fits."
    import threading
    import time as _time
    from concurrent.futures import ThreadPoolExecutor
    from basedirected.experiments import DevicePlacer, pack_memory_gib, run_placed
    from basedirected.groups import pack_groups
    specs = plan(PRESETS["paper"])
    packs = pack_groups([s.config for s in specs], 64)
    needs = [pack_memory_gib([specs[i].config for i in p]) for p in packs]
    budget = 0.9 * 139.0
    held, worst, lock = [0.0], [0.0], threading.Lock()
    def train(k):
        with lock: held[0] += needs[k]; worst[0] = max(worst[0], held[0])
        _time.sleep(0.002)
        with lock: held[0] -= needs[k]
        return k
    with ThreadPoolExecutor(8) as pool:  # the default 8 workers
        done = [k for k, _ in run_placed(needs, DevicePlacer([budget]), lambda k, d: pool.submit(train, k), jobs=8)]
    assert sorted(done) == list(range(len(packs)))
    assert worst[0] <= budget + 1e-9 and worst[0] > max(needs)  # within the budget, and more than one pack at a time


def test_a_sweep_finished_in_a_new_directory_merges_with_its_earlier_collection(smoke_dir, tmp_path, capsys):
    "Half the cells' run directories lost (a new machine): the rest collected with --earlier gives the earlier collection's tables byte for byte."
    import shutil
    reference, again = tmp_path / "reference", tmp_path / "again"
    reference.mkdir()
    for name in ("results.csv", "curves.csv", "positions.csv", "base_gates.json", "preset.json", "summary.json", "table.csv", "stats.csv", "success.csv", "success_parts.csv"):
        shutil.copy(smoke_dir / name, reference / name)
    keys = [s.key for s in plan(PRESETS["smoke"])]
    kept = keys[: len(keys) // 2]
    for name in ("bases", "preset.json"): (shutil.copytree if name == "bases" else shutil.copy)(smoke_dir / name, again / name)
    for k in kept: shutil.copytree(smoke_dir / "runs" / k, again / "runs" / k)
    assert repro_main(["--collect", "--out", str(again), "--earlier", str(reference), "--quiet"]) == 0
    rows = lambda d: list(csv.DictReader(open(d / "results.csv")))
    assert rows(again) == rows(reference)  # every figure of every run (the columns in another order: a collection reads metrics.json, sorted)
    for name in ("curves.csv", "positions.csv", "base_gates.json", "table.csv", "stats.csv", "success.csv", "success_parts.csv"):
        assert (again / name).read_bytes() == (reference / name).read_bytes(), name  # one machine: the same bytes
    summary = json.loads((again / "summary.json").read_text())
    assert summary["earlier"]["cells"] == len(keys) - len(kept) and summary["missing"] == []
    gates = json.loads((reference / "base_gates.json").read_text())
    name = next(iter(gates)); gates[name]["surprisal_per_token"] = math.nextafter(gates[name]["surprisal_per_token"], math.inf)  # one ulp: another machine's base
    (reference / "base_gates.json").write_text(json.dumps(gates))
    with pytest.raises(SystemExit) as e: repro_main(["--collect", "--out", str(again), "--earlier", str(reference), "--quiet"])
    assert e.value.code == 2 and "cannot be merged" in capsys.readouterr().err


def test_a_sweep_continued_in_another_sitting_trains_only_the_cells_its_earlier_collection_lacks(smoke_dir, tmp_path, capsys):
    "An earlier collection of half the cells, and its bases: the next sitting (--bases, --earlier) trains the other half to the same figures and merges."
    import shutil
    keys = [s.key for s in plan(PRESETS["smoke"])]
    half = set(keys[: len(keys) // 2])
    earlier, again = tmp_path / "earlier", tmp_path / "again"
    earlier.mkdir()
    for name in ("results.csv", "curves.csv", "positions.csv"):  # a collection that holds half the cells
        with open(smoke_dir / name, newline="") as f: r = csv.DictReader(f); rows, fields = [row for row in r if row["key"] in half], r.fieldnames
        with open(earlier / name, "w", newline="") as f: w = csv.DictWriter(f, fields, lineterminator="\n"); w.writeheader(); w.writerows(rows)
    for name in ("base_gates.json", "preset.json", "summary.json"): shutil.copy(smoke_dir / name, earlier / name)
    argv = ["--preset", "smoke", "--out", str(again), "--quiet", "--jobs", "1", "--earlier", str(earlier)]
    with pytest.raises(SystemExit) as e: repro_main(argv)  # its bases not seeded: refused before any cell trains
    assert e.value.code == 2 and "seed them with --bases" in capsys.readouterr().err and not (again / "runs").exists()
    shutil.copytree(smoke_dir / "bases", earlier / "bases", ignore=shutil.ignore_patterns("*.lock"))
    assert repro_main(argv + ["--bases", str(earlier / "bases")]) == 0
    assert sorted(p.name for p in (again / "runs").iterdir()) == sorted(set(keys) - half)  # the earlier cells are not trained again
    rows = lambda d: sorted((r for r in csv.DictReader(open(d / "results.csv"))), key=lambda r: r["key"])
    drop = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]
    assert drop(rows(again)) == drop(rows(smoke_dir))  # one machine, the same bases: every figure of every cell
    assert json.loads((again / "summary.json").read_text())["earlier"]["cells"] == len(half)


def test_only_trains_the_cells_its_pattern_matches_and_names_the_rest_missing(smoke_dir, tmp_path):
    "--only 'exact': the exact-posterior cells train, on the seeded base, to the same figures as the full sweep; the amortized ones are named missing."
    import shutil
    keys = [s.key for s in plan(PRESETS["smoke"])]
    out = tmp_path / "only"
    assert repro_main(["--preset", "smoke", "--out", str(out), "--quiet", "--jobs", "1", "--only", "exact-K3", "--bases", str(smoke_dir / "bases")]) == 1
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(k for k in keys if "-exact-" in k)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["only"] == "exact-K3" and sorted(summary["missing"]) == sorted(k for k in keys if "-exact-" not in k)
    rows = lambda d: {r["key"]: {k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(d / "results.csv"))}
    full = rows(smoke_dir)
    assert rows(out) == {k: full[k] for k in keys if "-exact-" in k}  # one machine, the same base: every figure of those cells
