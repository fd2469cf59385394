"""A run whose task's responses are narrated by a language model (`--narration`): the records it writes, the trace read back out of them, the
fine-tuned base's key and gate, the metrics, and the options it refuses."""
import json

import pytest
import torch
from hypothesis import given, strategies as st

pytest.importorskip("transformers")
pytest.importorskip("peft")

from basedirected.backbone import (ANSWER_MARK, narrate, narration_of, read_narration, read_pairs, read_trace, run_data, speaks_trace, step_ends, task_records,
                                   write_pairs)
from basedirected.cli import train_main
from basedirected.config import HFRunConfig, resolve_config
from basedirected.fine_tuning import base_key
from basedirected.runs import RunDir, read_json
from basedirected.tasks import Example, make_task
import basedirected.addition, basedirected.grid_pathfinding, basedirected.sorting  # noqa: F401  (they register their tasks)

SMALL = ["--backbone", "austen-gpt2", "--narration", "austen-gpt2", "--task", "sorting", "--regime", "short", "--n-train", "32", "--n-eval", "4",
         "--fine-tune-steps", "4", "--fine-tune-batch-size", "8", "--K", "3", "--posterior", "exact", "--steps", "2", "--batch-size", "8",
         "--eval-every", "2", "--c-samples", "4", "--n-routed", "2", "--n-forced", "2", "--device", "cpu", "--quiet",
         "--allow-failed-base"]

WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)


@given(st.sampled_from(("sorting", "addition", "grid_pathfinding")), st.integers(0, 10_000), st.lists(st.lists(WORDS, min_size=1, max_size=6), min_size=1, max_size=5))
def test_a_narrated_trace_reads_back_for_every_strategy(name, seed, sentences):
    "Whatever the narration (any words that are not the trace's), the trace read back is the trace, the checker finds its strategy, and the sentences come back out."
    task = make_task(name)
    said = [" ".join(" ".join(s).split()) for s in sentences if not speaks_trace(task, " ".join(s)) and " ".join(s).split()]
    if not said: said = ["Emma smiled."]
    ex = task.generate(1, seed)[0]
    for s in range(len(task.strategies)):
        y = task.render(ex.x, s)
        told = [said[i % len(said)] for i in range(len(step_ends(y)))]
        record = task_records(task, [Example(ex.x, tuple(y), s)], iter(told))[0]
        assert read_narration(task, record.response) == read_trace(task, record.response, narrated=True) == tuple(y)
        assert s in task.check(ex.x, read_narration(task, record.response)).strategies
        assert narration_of(task, record.response) == told and narrate(task, y, iter(told)) == record.response


def test_records_written_and_read_are_the_same(tmp_path):
    task = make_task("sorting")
    records = task_records(task, task.generate(5, 0), iter(["She smiled."] * 100))
    write_pairs(tmp_path / "d.jsonl", records)
    assert read_pairs(tmp_path / "d.jsonl") == records and not list(tmp_path.glob(".*tmp*"))


def test_narration_is_refused_where_it_cannot_apply(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1 2", "response": "1 2"}) + "\n")
    with pytest.raises(ValueError, match="narration narrates the task's own examples: give a task and no data"):
        HFRunConfig(backbone="austen-gpt2", data=str(tmp_path / "d.jsonl"), task="sorting", narration="austen-gpt2")
    with pytest.raises(ValueError, match="narration narrates the task's own examples"):
        HFRunConfig(backbone="austen-gpt2", data=str(tmp_path / "d.jsonl"), narration="austen-gpt2")
    with pytest.raises(ValueError, match="narration must name a language model"):
        HFRunConfig(backbone="austen-gpt2", task="sorting", narration=" ")


def test_a_plain_runs_base_keeps_the_key_it_was_saved_under():
    plain = resolve_config("sorting", backbone="austen-gpt2", overrides={"fine_tune.steps": 4})
    told = resolve_config("sorting", backbone="austen-gpt2", overrides={"fine_tune.steps": 4, "narration": "austen-gpt2"})
    assert "narration" not in base_key(plain) and base_key(told) == {**base_key(plain), "narration": "austen-gpt2"}


def test_an_unknown_narrator_is_one_line_naming_the_shipped_models(tmp_path, capsys):
    argv = [*SMALL, "--run-dir", str(tmp_path / "run")]
    argv[argv.index("--narration") + 1] = "no-such-model"
    with pytest.raises(SystemExit) as e: train_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "neither a shipped language model (austen-gpt2)" in err[0], err


def test_a_narrated_run_fine_tunes_gates_adapts_and_scores_the_traces_in_its_text(tmp_path):
    torch.set_num_threads(1)
    assert train_main([*SMALL, "--run-dir", str(tmp_path / "run")]) == 0
    rd, task = RunDir(tmp_path / "run"), make_task("sorting", "short")
    held, train = read_pairs(rd.eval_data), read_pairs(rd.train_data)
    assert (len(held), len(train)) == (4, 32)
    for r in held + train:  # every response is text around a valid trace: narration after every step, none of it the trace's words
        y = read_narration(task, r.response)
        assert task.check(tuple(int(t) for t in r.prompt.split()), y).valid and len(narration_of(task, r.response)) == len(step_ends(y))
    said = [s for r in train for s in narration_of(task, r.response)]
    assert len(said) > 2 * len(train) and len(set(said)) > 0.9 * len(said)  # sampled, not a few sentences repeated
    config = read_json(rd.config)["config"]
    assert config["narration"] == "austen-gpt2"
    assert read_json(rd.fine_tuned / "fine_tune.json")["key"]["narration"] == "austen-gpt2"
    gate = read_json(rd.gate)
    assert gate["base"]["narration"] == "austen-gpt2" and gate["n_inputs"] == 4
    m = read_json(rd.metrics)
    assert m["gen_n_forced_inputs"] == 2 and "gen_alignment_controlled_all" in m and "I_zs_given_x_norm" in m
    again = RunDir(tmp_path / "again"); again.path.mkdir()  # the same configuration draws and narrates the same records
    assert run_data(again, HFRunConfig.from_dict(config)) == (again.train_data, again.eval_data)
    assert again.eval_data.read_bytes() == rd.eval_data.read_bytes() and again.train_data.read_bytes() == rd.train_data.read_bytes()
    assert ANSWER_MARK in held[0].response
