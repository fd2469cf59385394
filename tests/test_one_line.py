"""Every check the package makes on the files it reads reaches the user as one line: a run directory's files damaged, swapped
or replaced, resumed by `basedirected-train` (its base shipped, or pre-trained here)."""
import shutil
from pathlib import Path

import pytest

from basedirected.cli import train_main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["--steps", "2", "--eval-every", "1", "--checkpoint-every", "1", "--quiet", "--no-metrics"]
HERE = ["--task", "sorting", "--n-train", "300", "--n-eval", "16", "--c-samples", "16", "--base-steps", "5", "--d-model", "16", "--n-layers", "1",
        "--n-heads", "2", "--d-ff", "32", "--max-len", "128", "--allow-failed-base", *SHIPPED]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    "Two runs stopped after their first step: one on the default run's shipped base, one on a base pre-trained here."
    root = tmp_path_factory.mktemp("stopped")
    for name, argv in (("shipped", SHIPPED), ("here", HERE)):
        assert train_main(["--run-dir", str(root / name), *argv, "--stop-after", "1"]) == 0
    return root


def _cut(p: Path): p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
def _garbage(p: Path): p.write_bytes(b"\x00not what this package wrote\xff" * 8)
def _link(p: Path): p.unlink(); p.symlink_to("/etc/hostname")
def _folder(p: Path): p.unlink(); p.mkdir()
def _other_shipped(p: Path): shutil.copy(ROOT / "basedirected" / "bases" / "addition-s0" / "base.pt", p)
def _base_checkpoint(p: Path): p.unlink(); _garbage(p.with_name("base_checkpoint.pt"))


CASES = [(run, f, damage) for run in ("shipped", "here") for f in ("base.pt", "checkpoint.pt", "reference_scale.json", "base_gate.json", "config.json")
         for damage in (_cut, _garbage, _link, _folder)] + [("shipped", "base.pt", _other_shipped), ("here", "base.pt", _base_checkpoint)]


@pytest.mark.parametrize("run, name, damage", CASES, ids=[f"{r}-{n}-{d.__name__[1:]}" for r, n, d in CASES])
def test_a_damaged_file_is_one_line_naming_it(stopped, tmp_path, capsys, run, name, damage):
    d = tmp_path / run
    shutil.copytree(stopped / run, d, symlinks=True)
    damage(d / name)
    argv = SHIPPED if run == "shipped" else HERE
    try: code = train_main(["--run-dir", str(d), *argv])
    except SystemExit as e: code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    errors = [l for l in err if "error:" in l]
    assert code in (0, 2) and "Traceback" not in "\n".join(err), err
    if code == 2: assert len(errors) == 1 and ("base" in errors[0] or name in errors[0]), err


def _nan_weights(p: Path):
    import torch
    ck = torch.load(p, weights_only=True)
    name = next(k for k, t in ck["model"].items() if t.is_floating_point())
    ck["model"][name] = ck["model"][name] * float("nan"); torch.save(ck, p)


def _huge_scale(p: Path):
    import json
    d = json.loads(p.read_text()); d[d["used"]]["value"] = 1e308; p.write_text(json.dumps(d))


def _flipped_verdict(p: Path):
    import json
    d = json.loads(p.read_text()); d["passes"] = not d["passes"]; p.write_text(json.dumps(d))


@pytest.mark.parametrize("name, damage, message", [("checkpoint.pt", _nan_weights, "non-finite weights"),
                                                   ("reference_scale.json", _huge_scale, "beyond any model's mean surprisal"),
                                                   ("base_gate.json", _flipped_verdict, "the record was changed")])
def test_load_run_refuses_what_a_resume_refuses(stopped, tmp_path, capsys, name, damage, message):
    from basedirected.runs import load_run
    d = tmp_path / "here"
    shutil.copytree(stopped / "here", d, symlinks=True)
    damage(d / name)
    with pytest.raises(ValueError, match=message): load_run(d)
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", str(d), *HERE])
    assert e.value.code == 2 and message in capsys.readouterr().err
