"""Readers that cannot be made to crash or hang: a record or table that is a special file, too large, nested too deep, ragged, with
NUL bytes or fields of the wrong type is refused by name; --compare checks REF is a collection of the same preset before any cell trains."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from basedirected.cluster import preset_from_record
from basedirected.runs import load_run, read_json, read_log, read_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["config.json", "eval.json", "metrics.json", "base_gate.json", "reference_scale.json"])
@pytest.mark.parametrize("damage", ["deep", "huge_field", "dev_zero", "fifo", "list", "folder"])
def test_a_run_record_that_is_no_record_is_refused_by_name(tmp_path, name, damage):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "reference" / "default-run", run)
    p = run / name
    p.unlink(missing_ok=True)
    if damage == "deep": p.write_text("{\"a\":" * 50_000 + "1" + "}" * 50_000)
    elif damage == "huge_field": p.write_text(json.dumps({"a": "x" * 300_000}))
    elif damage == "dev_zero": p.symlink_to("/dev/zero")
    elif damage == "fifo": __import__("os").mkfifo(p)
    elif damage == "list": p.write_text("[1, 2]")
    else: p.mkdir()
    if damage == "huge_field": read_json(p); return  # large but well-formed: read
    with pytest.raises(ValueError, match=str(p)): read_json(p)
    if name == "config.json":
        with pytest.raises(ValueError, match="config.json"): load_run(run)


def test_a_log_linked_to_a_device_is_refused(tmp_path):
    (tmp_path / "log.jsonl").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"): read_log(tmp_path / "log.jsonl")


@pytest.mark.parametrize("text, message", [("key,rate\na,1,2\n", "row 1 has 3 fields"), ("key,rate\na\n", "row 1 has 1 fields"), ("rate\n1\n", "no column 'key'"),
                                           ("key\n\0\n", "NUL byte"), ("key\n" + "y" * 200_000 + "\n", "field larger than field limit"),
                                           (b"key\n\xff\xfe\n", "not UTF-8 text")])
def test_a_damaged_results_table_is_refused_by_name(tmp_path, text, message):
    p = tmp_path / "results.csv"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message): read_table(p, ("key",))


@pytest.mark.parametrize("field, value", [("arms", "not a list"), ("knobs", [1, 2]), ("model", "tiny"), ("seeds", {"a": 1}), ("arms", [{"knobs": 3}])])
def test_a_preset_record_of_the_wrong_shape_is_refused_by_name(tmp_path, field, value):
    shutil.copy(ROOT / "reference" / "quick" / "preset.json", tmp_path / "preset.json")
    record = json.loads((tmp_path / "preset.json").read_text()); record["preset"][field] = value
    (tmp_path / "preset.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="preset.json"): preset_from_record(tmp_path)


def _ref(tmp_path, name, results, preset="quick"):
    ref = tmp_path / name; ref.mkdir()
    (ref / "results.csv").write_text(results)
    shutil.copy(ROOT / "reference" / preset / "preset.json", ref / "preset.json")
    return ref


@pytest.mark.parametrize("case, message", [("empty", "holds no cell"), ("header", "holds no cell"), ("nokey", "no column 'key'"),
                                           ("other", "is a collection of preset 'study', not 'quick'"), ("foreign", "has no cell of preset quick")])
def test_compare_refuses_a_reference_that_is_no_collection_of_the_preset_before_training(tmp_path, case, message):
    ref = {"empty": lambda: _ref(tmp_path, "r", ""), "header": lambda: _ref(tmp_path, "r", "key,rate\n"), "nokey": lambda: _ref(tmp_path, "r", "rate\n1\n"),
           "other": lambda: _ref(tmp_path, "r", (ROOT / "reference" / "study" / "results.csv").read_text(), "study"),
           "foreign": lambda: _ref(tmp_path, "r", "key,rate\nnot-a-cell,1\n")}[case]()
    r = subprocess.run(["basedirected-repro", "--preset", "quick", "--out", str(tmp_path / "out"), "--compare", str(ref)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (tmp_path / "out" / "runs").exists()  # refused before any cell trained
