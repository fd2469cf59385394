"""A run directory and a collection are data: no record makes the package import a module, a sweep writes and deletes only
inside its collection, and an export's clean-up removes only its own partial folders."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "import pathlib; pathlib.Path({marker!r}).write_text('ran')\nfrom basedirected.tasks import Task\nclass T(Task): name = 'planted'\n"


def _plant(where: Path, module: str, marker: Path):
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{module}.py").write_text(PLANTED.format(marker=str(marker)))


def _tiny_run_record(run: Path, module: str):
    "The committed default run's record, its task named as a module:Class of the planted module (an unregistered name)."
    shutil.copytree(ROOT / "reference" / "default-run", run)
    record = json.loads((run / "config.json").read_text())
    record["task_class"], record["config"]["task"]["name"] = f"{module}:T", "planted"
    (run / "config.json").write_text(json.dumps(record))


def _hf_run_record(run: Path, module: str):
    from basedirected.config import HFRunConfig
    run.mkdir(parents=True)
    config = {**HFRunConfig(str(run / "backbone"), str(run / "data.jsonl")).to_dict(), "task": f"{module}:T"}
    (run / "config.json").write_text(json.dumps({"config": config, "environment": {"torch": "x"}, "loader": "basedirected.hf:load_hf_run"}))
    (run / "checkpoint.pt").write_bytes(b"not read")


def _python(code: str, cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


READ_ALL = """
import contextlib, io, sys
from basedirected.runs import load_run
from basedirected.cli import export_main
for run in sys.argv[1:3]:
    try: load_run(run); print("loaded", run)
    except ValueError as e: print("refused:", e)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try: export_main([sys.argv[2], sys.argv[3]])
    except SystemExit as e: print("export exit", e.code, "lines", err.getvalue().count(chr(10)), err.getvalue().strip())
"""


def test_a_module_named_by_a_record_never_runs(tmp_path):
    "Modules planted beside the run directories and inside them, named by their records ('this', the standard library's, and one of the user's): load_run, export and a resume, run from beside and from inside, refuse by name, and no module's top-level code runs."
    marker, run, hf_run = tmp_path / "ran.txt", tmp_path / "run", tmp_path / "hf-run"
    _tiny_run_record(run, "this"); _hf_run_record(hf_run, "planted_tasks")
    for d in (tmp_path, run, hf_run):
        for module in ("this", "planted_tasks"): _plant(d, module, marker)
    for cwd in (tmp_path, run):
        r = _python(READ_ALL, cwd, run, hf_run, tmp_path / "out")
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        assert [l.split(":")[0] for l in lines[:2]] == ["refused", "refused"] and all("a record never imports code" in l for l in lines), r.stdout
        assert lines[2].startswith("export exit 2 lines 1 basedirected-export: error:"), lines[2]
        assert not marker.exists() and not (tmp_path / "out").exists() and "Zen of Python" not in r.stdout
        # a resume takes its task from its own command line: the record's name is compared, never imported
        r = subprocess.run(["basedirected-train", "--run-dir", str(run), "--quiet"], capture_output=True, text=True, cwd=cwd, timeout=300)
        assert r.returncode == 2 and "holds a run with a different configuration" in r.stderr and not marker.exists(), r.stderr


def test_collect_reads_records_without_importing_a_module_they_name(tmp_path):
    "A sweep cell whose record names a planted module: --collect from the collection's folder reads it as data."
    marker, out = tmp_path / "ran.txt", tmp_path / "sweep"
    shutil.copytree(ROOT / "reference" / "default-run", out / "runs" / "cell")
    record = json.loads((out / "runs" / "cell" / "config.json").read_text())
    record["task_class"] = "planted_tasks:T"
    (out / "runs" / "cell" / "config.json").write_text(json.dumps(record))
    shutil.copy(ROOT / "reference" / "quick" / "preset.json", out / "preset.json")
    for d in (out, out / "runs" / "cell"): _plant(d, "planted_tasks", marker)
    for cwd in (out, out / "runs" / "cell"):
        _python("import sys; from basedirected.repro import repro_main; repro_main(['--collect', '--out', sys.argv[1]])", cwd, out)
        assert not marker.exists()


def test_a_task_of_the_users_own_is_imported_only_when_the_user_names_it(tmp_path, monkeypatch):
    "In code, task_class('module:Class') imports where Python finds the module, never the working directory; a record's name (imports=False) only finds one already imported."
    from basedirected.tasks import task_class
    marker = tmp_path / "ran.txt"
    _plant(tmp_path, "cwd_only_tasks", marker)
    monkeypatch.chdir(tmp_path); monkeypatch.delitem(sys.modules, "cwd_only_tasks", raising=False)
    with pytest.raises(ValueError, match="the working directory is not searched"): task_class("cwd_only_tasks:T")
    with pytest.raises(ValueError, match="is not imported, and a record never imports code"): task_class("cwd_only_tasks:T", imports=False)
    assert not marker.exists()


def test_a_cell_linked_outside_its_collection_is_never_written_or_deleted(tmp_path):
    "runs/<cell> a link to a folder elsewhere: rerunning the sweep (and --force --only) refuses by name, and the folder outside is unchanged."
    from basedirected.presets import PRESETS, plan
    out, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
    spec = plan(PRESETS["smoke"])[0]
    elsewhere.mkdir(); (elsewhere / "config.json").write_text('{"config": {}, "note": "a run of someone else"}'); (elsewhere / "notes.txt").write_text("keep")
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    (out / "runs").mkdir(parents=True); (out / "runs" / spec.key).symlink_to(elsewhere, target_is_directory=True)
    for extra in ([], ["--force", "--only", spec.key]):
        r = subprocess.run(["basedirected-repro", "--preset", "smoke", "--out", str(out), "--device", "cpu", *extra],
                           capture_output=True, text=True, timeout=600)
        errors = [l for l in r.stderr.splitlines() if "error:" in l]  # (the progress bar shares stderr)
        assert r.returncode == 2 and len(errors) == 1 and "outside the collection" in errors[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_export_clears_only_its_own_partials(tmp_path):
    "The clean-up of killed exports matches `.OUT.partial<pid>` literally: a user's `.exp.partial-notes`, a file, a link, and with OUT '*' or '[ab]' any other folder are kept."
    from basedirected.hf import stale_partials
    for name in (".exp.partial123", ".exp.partial-notes", ".exp.partial12a", ".exp.partial١٢", "a", "b", ".a.partial7x"): (tmp_path / name).mkdir()
    (tmp_path / ".exp.partial9").write_text("a file")
    (tmp_path / ".exp.partial8").symlink_to(tmp_path / "a", target_is_directory=True)
    assert [p.name for p in stale_partials(tmp_path / "exp")] == [".exp.partial123"]
    for pattern in ("*", "[ab]", "?", ".exp.*"): assert stale_partials(tmp_path / pattern) == []
