"""The compatibility rule: a field added to any configuration class (run, training, CVAE, base, task) with its default leaves
every committed run directory, every shipped base and every collection's cells the same configuration — and the test fails when
the rule is taken away."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import basedirected.conventions as conventions
import basedirected.pretrained as pretrained
from basedirected.base import BaseTrainConfig
from basedirected.config import RunConfig, TrainConfig
from basedirected.conventions import same_configuration
from basedirected.cvae import CVAEConfig
from basedirected.experiments import _stale
from basedirected.presets import PRESETS, plan
from basedirected.model import ModelConfig
from basedirected.pretrained import catalogue, check_pretrained, pretrained_for, same_recipe
from basedirected.runs import RunDir, check_run_dir
from basedirected.tasks import Task, task_from_dict

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("run", "train", "cvae", "base", "task")


@pytest.fixture(autouse=True)
def _registry(monkeypatch):
    monkeypatch.setattr(Task, "registry", dict(Task.registry))  # a grown task class registers under its parent's name here only


def _grown(cls):
    "`cls` with one field more, at its default: what a release that adds a knob ships."
    return dataclasses.make_dataclass(cls.__name__, [("added_knob", float, dataclasses.field(default=0.0))], bases=(cls,), frozen=True)


def grow(config: RunConfig, which: str) -> RunConfig:
    "`config` with the added field in the class `which` names (the same values otherwise)."
    fields = lambda obj: {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if which == "run": return _grown(RunConfig)(**fields(config))
    part = {"train": "train", "cvae": "cvae", "base": "base", "task": "task"}[which]
    obj = getattr(config, part)
    return dataclasses.replace(config, **{part: _grown(type(obj))(**fields(obj))})


def _shipped_configs():
    for name, b in catalogue().items():
        k = b.key
        base = BaseTrainConfig(**{**k["base_config"], "model": ModelConfig(**k["base_config"]["model"])})
        yield name, RunConfig(task=task_from_dict(k["task"]), base=base, n_train=k["n_train"], base_seed=k["seed"])


@pytest.mark.parametrize("which", CLASSES)
def test_a_field_added_with_its_default_keeps_every_record(which, tmp_path):
    # the committed run directory: the same configuration, and a resume of it is not refused
    record = json.loads((ROOT / "reference" / "default-run" / "config.json").read_text())
    grown = grow(RunConfig.from_dict(record["config"]), which)
    assert "added_knob" in json.dumps(grown.to_dict()) and same_configuration(record["config"], grown.to_dict(), grown)
    shutil.copytree(ROOT / "reference" / "default-run", tmp_path / "run")
    check_run_dir(tmp_path / "run", grown)
    # every shipped base still serves its recipe
    for name, config in _shipped_configs():
        g = grow(config, which)
        assert same_recipe(catalogue()[name].key, g) and pretrained_for(g) == name and check_pretrained(name, g)
    # a collection's cell written before the field is not stale (a sweep would delete and rerun it)
    for preset in ("smoke", "settled", "entropy"):
        for spec in plan(PRESETS[preset])[:3]:
            rd = RunDir(tmp_path / "cells" / preset / spec.key); rd.path.mkdir(parents=True)
            rd.config.write_text(json.dumps({"config": spec.config.to_dict()}))
            assert not _stale(rd, dataclasses.replace(spec, config=grow(spec.config, which)))


@pytest.mark.parametrize("which", CLASSES)
def test_the_test_fails_without_the_rule(which, monkeypatch):
    "With plain equality in place of the rule, the same record is another configuration and the shipped bases serve no one."
    plain = lambda record, shape: conventions._as_json(record)
    monkeypatch.setattr(conventions, "with_defaults", plain); monkeypatch.setattr(pretrained, "with_defaults", plain)
    record = json.loads((ROOT / "reference" / "default-run" / "config.json").read_text())
    grown = grow(RunConfig.from_dict(record["config"]), which)
    assert not same_configuration(record["config"], grown.to_dict(), grown)
    name, config = next(_shipped_configs())
    assert not same_recipe(catalogue()[name].key, grow(config, which)) or which in ("run", "train", "cvae")  # a base key holds no run, train or CVAE field


def test_a_field_whose_absence_means_something_else_says_so():
    "flush_subnormals: a record from before it ran without flushing, so it is not the default run's configuration."
    record = json.loads((ROOT / "reference" / "default-run" / "config.json").read_text())
    older = {k: v for k, v in record["config"].items() if k != "flush_subnormals"}
    config = RunConfig.from_dict(record["config"])
    assert same_configuration(record["config"], config.to_dict(), config)
    assert same_configuration(older, config.to_dict(), config) == (config.flush_subnormals is False)
