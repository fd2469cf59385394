"""The shipped bases: the catalogue is what it says, a run adapts from the base of its recipe and records it, and a changed or
mismatched file is refused by name before any work."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from basedirected.base import gate_failures
from basedirected.cli import train_main
from basedirected.config import build_parser, config_from_args
from basedirected.pretrained import BASE_FILES, base_key, catalogue, check_pretrained, file_sha256, pretrained_for, same_recipe, verify_pretrained
from basedirected.runs import RunDir, load_run, prepare_run
from basedirected.config import resolve_config

QUICK = {"train.steps": 4, "train.eval_every": 2, "train.checkpoint_every": 2, "n_eval": 16, "metrics.n_routed": 8, "metrics.n_forced": 4}


@pytest.mark.parametrize("name", list(catalogue()))
def test_every_shipped_base_is_what_its_entry_says(name):
    b = catalogue()[name]
    verify_pretrained(b)  # every file, by checksum
    ck = torch.load(b.path / "base.pt", map_location="cpu", weights_only=True)
    key = json.loads(json.dumps({k: ck[k] for k in ("base_config", "seed", "task", "n_train")}))
    gate, scale = (json.loads((b.path / f).read_text()) for f in ("base_gate.json", "reference_scale.json"))
    assert b.key == key == gate["base"] == scale["base"]  # the model, its gate and its c_theta describe one recipe
    assert gate["passes"] == (not gate_failures(gate)) and scale["c_samples"] == 2000  # the verdict is the figures', the estimate the runs' default
    assert name.startswith(key["task"]["name"]) and name.endswith(f"-s{key['seed']}")


def test_the_default_run_adapts_from_the_shipped_sorting_base_and_records_it(tmp_path):
    cfg = resolve_config(overrides=QUICK)
    assert pretrained_for(cfg) == "sorting-s0"
    run = prepare_run(tmp_path / "run", cfg, device="cpu")
    rd = RunDir(tmp_path / "run")
    assert all((rd.path / f).read_bytes() == (catalogue()["sorting-s0"].path / f).read_bytes() for f in BASE_FILES)  # installed, not trained
    assert json.loads(rd.config.read_text())["shipped_base"] == "sorting-s0" and not rd.base_checkpoint.exists()
    assert run.c_ref == json.loads((rd.path / "reference_scale.json").read_text())["model"]["value"]


def test_a_changed_shipped_base_is_refused_by_name_on_resume_and_on_load(tmp_path):
    cfg = resolve_config(overrides=QUICK)
    prepare_run(tmp_path / "run", cfg, device="cpu")
    ck = torch.load(tmp_path / "run" / "base.pt", weights_only=True)
    ck["model"]["embed.weight"][0, 0] += 1.0  # one weight changed; the recipe the file names is the same
    torch.save(ck, tmp_path / "run" / "base.pt")
    for attempt in (lambda: prepare_run(tmp_path / "run", cfg, device="cpu"), lambda: load_run(tmp_path / "run")):
        with pytest.raises(ValueError, match="base.pt is not the shipped base sorting-s0's base.pt \\(its checksum differs"): attempt()


def test_train_base_trains_its_own_and_refuses_a_directory_holding_a_shipped_one(tmp_path, capsys):
    tiny = ["--steps", "2", "--eval-every", "1", "--checkpoint-every", "1", "--n-eval", "16", "--no-metrics", "--quiet"]
    assert train_main(["--run-dir", str(tmp_path / "shipped"), *tiny, "--allow-failed-base"]) == 0
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", str(tmp_path / "shipped"), *tiny, "--train-base"])
    assert e.value.code == 2 and "base.pt is the shipped base sorting-s0, and the run asks to train its own (--train-base)" in capsys.readouterr().err
    own = tmp_path / "own"  # a base trained here: a small recipe, so that the test is quick
    assert train_main(["--run-dir", str(own), *tiny, "--train-base", "--base-steps", "30", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
                       "--n-train", "300", "--c-samples", "16", "--allow-failed-base"]) == 0
    assert json.loads((own / "config.json").read_text())["shipped_base"] is None and (own / "base.pt").read_bytes() != (tmp_path / "shipped" / "base.pt").read_bytes()


def test_base_by_name_brings_its_recipe_and_refuses_another(capsys):
    parse = lambda *argv: config_from_args(build_parser().parse_args(list(argv)))
    cfg = parse("--base", "addition-s1", "--objective", "dist")
    assert same_recipe(catalogue()["addition-s1"].key, cfg) and (cfg.task.name, cfg.seed, cfg.objective) == ("addition", 0, "dist")
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", "/tmp/never", "--base", "addition-s1", "--task", "sorting"])
    assert e.value.code == 2 and "--base addition-s1 brings its own task" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", "/tmp/never", "--base", "sorting-s9"])
    assert e.value.code == 2 and "no shipped base is named 'sorting-s9'; the shipped bases are sorting-s0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"base_config.steps 5000, not 40 \(drop --base"): check_pretrained("sorting-s0", parse("--base-steps", "40"))


def test_commands_need_no_optional_extra_for_help_and_name_the_extra_they_need(tmp_path):
    "basedirected-export without transformers: its help, then one line naming the extra; the docs build without nbdev: one line."
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['peft'] = None; sys.modules['nbdev'] = None\n"
            "from basedirected.launch import export, docs\n"
            "try: export(sys.argv[1:])\nexcept SystemExit as e: print('exit', e.code)")
    run = lambda *argv: subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    helped = run("--help")
    assert "usage: basedirected-export" in helped.stdout and "exit 0" in helped.stdout, helped.stderr
    refused = run(str(tmp_path / "run"), str(tmp_path / "out"))
    assert "exit 2" in refused.stdout and refused.stderr.strip().endswith("pip install -e '.[hf]'") and len(refused.stderr.strip().splitlines()) == 1
    docs = subprocess.run([sys.executable, "-c", code.replace("export(sys.argv[1:])", "docs([])")], capture_output=True, text=True, timeout=120)
    assert "exit 2" in docs.stdout and "pip install -e '.[dev]'" in docs.stderr and len(docs.stderr.strip().splitlines()) == 1


def test_a_quick_cell_rerun_on_the_references_cpu_type_equals_the_reference(tmp_path):
    "reference/quick adapts from a shipped base: on the CPU type it was made on, a rerun of a cell equals it in every figure (elsewhere --compare reports the seed range)."
    from pathlib import Path
    from basedirected.cluster import read_records
    from basedirected.reports import compare_collections
    from basedirected.repro import repro_main
    from basedirected.machine import cpu_model
    ref = Path(__file__).resolve().parents[1] / "reference" / "quick"
    made_on = json.loads((ref / "summary.json").read_text())["environment"]["cpu"]
    if made_on != cpu_model(): pytest.skip(f"reference/quick was made on {made_on}, this is {cpu_model()}: other kernels, other round-off")
    key = "early-discrete-exact-K3-theta_a0.5_g1.0-t0.07-s1"
    assert repro_main(["--preset", "quick", "--out", str(tmp_path), "--only", f"^{key}$", "--quiet", "--jobs", "1"]) == 1  # the other cells: missing
    (mine,) = [r for r in read_records(tmp_path) if r["key"] == key]
    (theirs,) = [r for r in read_records(ref) if r["key"] == key]
    assert all(r["exact"] == r["cells"] == 1 for r in compare_collections([mine], [theirs]))
    shared = (set(mine) & set(theirs)) - {"seconds", "git_revision", "git_dirty"}
    assert {k: mine[k] for k in shared} == {k: theirs[k] for k in shared}  # every column both have but time and provenance (this tree's revision)
    assert set(theirs) <= set(mine) and set(mine) - set(theirs) <= {"git_revision", "git_dirty", "cpu", "revealing_share", "settled_strict", "loss_fall_last", "gen_n_forced_inputs", "base_b_mean", "base_b_cv", "base_b_top10_share"}  # columns added since it was made


def test_base_names_the_base_model_only_and_the_former_keywords_warn_for_a_release(tmp_path):
    "'base' is the base model and its configuration (RunConfig.base); a shipped base by name is `shipped_base`, where a run's base comes from `base_from`."
    with pytest.warns(DeprecationWarning, match=r"resolve_config\(base=...\) is now resolve_config\(shipped_base=...\)"):
        old = resolve_config(base="sorting-s0")
    assert old == resolve_config(shipped_base="sorting-s0")
    with pytest.raises(ValueError, match="base= and shipped_base= are one setting"): resolve_config(base="sorting-s0", shipped_base="sorting-s1")
    with pytest.warns(DeprecationWarning, match=r"prepare_run\(base=...\) is now prepare_run\(base_from=...\)"):
        with pytest.raises(ValueError, match="no shipped base is named 'sorting-s9'"): prepare_run(tmp_path / "run", resolve_config(overrides=QUICK), device="cpu", base="sorting-s9")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_run_recorded_before_shipped_base_had_its_name_resumes_loads_and_is_recorded_anew(tmp_path):
    from basedirected.runs import recorded_shipped_base
    cfg = resolve_config(overrides=QUICK)
    rd = RunDir(tmp_path / "run")
    prepare_run(rd.path, cfg, device="cpu")
    record = json.loads(rd.config.read_text())
    old = {"base" if k == "shipped_base" else k: {"shipped": v} if k == "shipped_base" else v for k, v in record.items()}  # the former record
    rd.config.write_text(json.dumps(old))
    assert recorded_shipped_base(old) == recorded_shipped_base(record) == "sorting-s0"
    load_run(rd.path)  # the former record loads (its shipped base verified by checksum)
    prepare_run(rd.path, cfg, device="cpu")  # and resumes
    assert json.loads(rd.config.read_text())["shipped_base"] == "sorting-s0" and "base" not in json.loads(rd.config.read_text())
