"""The configuration's vocabulary held still: every cell of every preset is the command that trains it, every committed collection's
cells are cells of its preset, and every preset's keys are those recorded (so a collection resumes and merges after a change)."""
import csv
import hashlib
import json
from pathlib import Path

import pytest

from basedirected.config import build_parser, config_from_args, hf_config_from_args
from basedirected.presets import PRESETS, plan, with_backbone

ROOT = Path(__file__).resolve().parents[1]
KEYS = ROOT / "tests" / "data" / "preset_keys.json"  # each preset's cell keys when this test was written: count, digest, first and last


def _collections():
    "(folder, preset) of every committed collection of a sweep."
    for summary in sorted(ROOT.glob("reference/*/summary.json")):
        preset = json.loads(summary.read_text())["preset"]
        yield summary.parent, preset["name"] if isinstance(preset, dict) else preset


def _planned(name: str) -> list:
    "A preset's cells; one sized for a language model on a backbone directory of that model's name (read when a cell runs, never when planned)."
    preset = PRESETS[name]
    return plan(with_backbone(preset, "/models/Qwen2.5-0.5B") if preset.needs_backbone else preset)


def key_record(name: str) -> dict:
    keys = [s.key for s in _planned(name)]
    return {"cells": len(keys), "sha256": hashlib.sha256("\n".join(keys).encode()).hexdigest(), "first": keys[0], "last": keys[-1]}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_cell_of_every_preset_is_the_command_that_trains_it(name):
    parser = build_parser()
    from_args = hf_config_from_args if PRESETS[name].needs_backbone else config_from_args  # basedirected-train's two resolvers
    for spec in _planned(name):
        assert from_args(parser.parse_args(list(spec.argv))) == spec.config, spec.key
        assert spec.config.objective in (spec.objective, "custom"), spec.key


@pytest.mark.parametrize("folder, preset", list(_collections()), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_committed_collection_holds_cells_of_its_preset(folder, preset):
    keys = {r["key"] for r in csv.DictReader(open(folder / "results.csv"))}
    planned = {s.key for s in plan(PRESETS[preset])}
    assert keys and keys <= planned, f"{folder.name}: {len(keys - planned)} cells its preset no longer has, e.g. {sorted(keys - planned)[:3]}"


def test_every_presets_keys_are_the_recorded_ones():
    recorded = json.loads(KEYS.read_text())
    assert sorted(recorded) == sorted(PRESETS), "a preset was added or removed: record its keys in tests/data/preset_keys.json"
    now = {name: key_record(name) for name in PRESETS}
    changed = {name: (recorded[name]["cells"], now[name]["cells"]) for name in PRESETS if now[name] != recorded[name]}
    assert not changed, f"cell keys changed (recorded cells, now): {changed}; a collection made before would neither resume nor merge"
