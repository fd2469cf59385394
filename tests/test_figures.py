"""Every committed figure is what the reporting functions draw from its collection's files today.

A collection's figures (`reference/<name>/figures/`) are saved with their data (`<name>.json`, read back from the drawn
figure by `figure_data`) and that data's digest in the PNG's and SVG's metadata. Redrawing a collection's figures from its
files and comparing the data number by number catches a figure drawn by an older rule, a file changed after its figure
was drawn, and an image that does not show the data beside it. `RUN_FIGURES` are drawn from run directories, which a
collection leaves out: they are the only committed figures not redrawn here.
"""
import csv
import math
import shutil
from pathlib import Path

import matplotlib
import pytest
from PIL import Image

matplotlib.use("Agg")

import basedirected.reports as reports
from basedirected.reports import RUN_FIGURES, figure_data, figure_digest, write_figures
from basedirected.runs import read_json

REFERENCE = Path(__file__).resolve().parent.parent / "reference"
COLLECTIONS = sorted(p.parent.name for p in REFERENCE.glob("*/figures"))


def _first_difference(now, committed, where="figure"):
    "Where two figures' data first differ (floats within a relative 1e-5: six significant digits either side), or None."
    if isinstance(now, float) and isinstance(committed, (int, float)):
        return None if math.isclose(now, committed, rel_tol=1e-5, abs_tol=1e-12) else f"{where}: {now!r} now, {committed!r} committed"
    if isinstance(now, dict) and isinstance(committed, dict):
        if now.keys() != committed.keys(): return f"{where}: keys {sorted(now)} now, {sorted(committed)} committed"
        return next((d for k in now if (d := _first_difference(now[k], committed[k], f"{where}.{k}"))), None)
    if isinstance(now, list) and isinstance(committed, list):
        if len(now) != len(committed): return f"{where}: {len(now)} items now, {len(committed)} committed"
        return next((d for i, (a, b) in enumerate(zip(now, committed)) if (d := _first_difference(a, b, f"{where}[{i}]"))), None)
    return None if now == committed else f"{where}: {now!r} now, {committed!r} committed"


def _redrawn(out: Path, monkeypatch) -> dict:
    "Each figure `write_figures` draws from `out`'s files, as data, by name: nothing is written."
    drawn = {}
    monkeypatch.setattr(reports, "_save", lambda fig, _out, name: drawn.__setitem__(name, figure_data(fig)))
    write_figures(out)
    return drawn


def test_there_are_collections_with_figures_to_redraw():
    assert {"rescaling", "settled", "quick"} <= set(COLLECTIONS), COLLECTIONS


@pytest.mark.parametrize("name", COLLECTIONS)
def test_every_committed_figure_is_what_the_reporting_functions_draw_from_its_files_now(name, monkeypatch):
    figures = REFERENCE / name / "figures"
    drawn = _redrawn(REFERENCE / name, monkeypatch)
    committed = {p.stem for p in figures.glob("*.png")}
    assert committed - set(RUN_FIGURES) == set(drawn), f"{name}: committed but not drawn from its files {sorted(committed - set(RUN_FIGURES) - set(drawn))}, drawn but not committed {sorted(set(drawn) - committed)}"
    for fig, data in drawn.items():
        stored = read_json(figures / f"{fig}.json")
        assert (diff := _first_difference(data, stored)) is None, f"{name}/{fig}: {diff}"
        described = f"figure data sha256 {figure_digest(stored)}"
        assert Image.open(figures / f"{fig}.png").text.get("Description") == described, f"{name}/{fig}.png was not drawn from {fig}.json"
        assert described in (figures / f"{fig}.svg").read_text(), f"{name}/{fig}.svg was not drawn from {fig}.json"


def test_a_changed_number_in_a_collection_changes_its_figure_and_the_comparison_names_where(tmp_path, monkeypatch):
    out = tmp_path / "rescaling"
    shutil.copytree(REFERENCE / "rescaling", out)
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f); fields, rows = reader.fieldnames, list(reader)
    rows[0]["gen_alignment_controlled_all_excess"] = repr(float(rows[0]["gen_alignment_controlled_all_excess"]) + 0.05)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields); w.writeheader(); w.writerows(rows)
    diff = _first_difference(_redrawn(out, monkeypatch)["answer"], read_json(out / "figures" / "answer.json"))
    assert diff is not None and diff.startswith("figure.panels["), diff
