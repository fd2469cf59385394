"""The task interface's laws on every concrete task: valid generated traces, rejected corruptions, ties, seeds, JSON, vocabulary, export."""
import json
import math
import zlib

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from basedirected.addition import Addition, addition_input
from basedirected.grid_pathfinding import GridPathfinding, grid_input
from basedirected.model import layout_tokens
from basedirected.sorting import Sorting
from basedirected.tasks import SPECIALS, Example, Vocab, export_jsonl, task_from_dict
from basedirected.visiting_order import VisitingOrder

NEW_TASKS = {
    "sorting": Sorting(), "sorting_short": Sorting.short(), "sorting_long": Sorting.long(),
    "grid": GridPathfinding(), "grid_small": GridPathfinding.small(), "grid_large": GridPathfinding.large(), "grid_open": GridPathfinding.open(),
    "addition": Addition(), "addition_short": Addition.short(), "addition_long": Addition.long(),
}
ALL_TASKS = {**NEW_TASKS, "visiting_order": VisitingOrder()}
new_tasks = pytest.mark.parametrize("task", NEW_TASKS.values(), ids=NEW_TASKS.keys())
all_tasks = pytest.mark.parametrize("task", ALL_TASKS.values(), ids=ALL_TASKS.keys())
seeds = st.integers(0, 2 ** 32 - 1)


def renders(task, x):
    return [task.render(x, s) for s in range(len(task.strategies))]


def writers(task, x, y):
    "Every strategy whose trace on x is y: the independent reference for `check(...).strategies`."
    return tuple(s for s, r in enumerate(renders(task, x)) if r == tuple(y))


def after_equals(y):
    return tuple(y[y.index("=") + 1:])


# --- generated examples are valid, with their own strategy and the right answer

@all_tasks
@given(seed=seeds)
def test_generated_examples_check_valid(task, seed):
    for e in task.generate(4, seed):
        c = task.check(e.x, e.y)
        assert c.valid and e.strategy in c.strategies and c.answer_correct
        if task.deterministic: assert c.strategies == writers(task, e.x, e.y) and e.y == task.render(e.x, e.strategy)


@new_tasks
@given(seed=seeds)
def test_answer_is_what_follows_the_equals_sign(task, seed):
    for e in task.generate(4, seed):
        assert after_equals(e.y) == tuple(task.answer(e.x).split())


def test_answers_against_independent_references():
    for e in Sorting().generate(50, 0): assert task_answer_ints(Sorting(), e) == sorted(e.x)
    for e in Addition.long().generate(50, 0):
        k = e.x.index("+")
        assert int("".join(after_equals(e.y))) == int("".join(map(str, e.x[:k]))) + int("".join(map(str, e.x[k + 1:])))
    for e in GridPathfinding().generate(50, 0):
        s, g = divmod(e.x.index("S"), 5), divmod(e.x.index("G"), 5)
        assert int(after_equals(e.y)[0]) == abs(s[0] - g[0]) + abs(s[1] - g[1]) == (len(e.y) - 4) // 3


def task_answer_ints(task, e):
    return [int(t) for t in after_equals(e.y)]


# --- corrupted traces are rejected

@new_tasks
@given(seed=seeds, data=st.data())
def test_swapped_tokens_are_invalid(task, seed, data):
    e = task.generate(1, seed)[0]
    cut = e.y.index("=")
    pairs = [(i, j) for i in range(cut) for j in range(i + 1, cut) if e.y[i] != e.y[j]]
    i, j = data.draw(st.sampled_from(pairs))
    bad = list(e.y); bad[i], bad[j] = bad[j], bad[i]
    assume(tuple(bad) not in renders(task, e.x))  # a swap that happens to write another strategy's trace is not a corruption
    c = task.check(e.x, bad)
    assert not c.valid and c.strategies == () and c.answer_correct  # the answer part is untouched


@new_tasks
@given(seed=seeds)
def test_wrong_answer_is_invalid_and_incorrect(task, seed):
    e = task.generate(1, seed)[0]
    last = e.y[-1]
    wrong = e.y[:-1] + (str((int(last) + 1) % 10),)
    c = task.check(e.x, wrong)
    assert not c.valid and not c.answer_correct


@new_tasks
@given(seed=seeds, data=st.data())
def test_truncated_traces_are_invalid(task, seed, data):
    e = task.generate(1, seed)[0]
    k = data.draw(st.integers(0, len(e.y) - 1))
    c = task.check(e.x, e.y[:k])
    assert not c.valid and c.strategies == ()
    if k <= e.y.index("="): assert not c.answer_correct  # the answer is not written yet


@new_tasks
@given(seed=seeds)
def test_trace_of_another_input_is_invalid(task, seed):
    e, f = task.generate(2, seed)
    assume(e.y not in renders(task, f.x))
    assert not task.check(f.x, e.y).valid


@new_tasks
def test_empty_and_garbage_responses(task):
    e = task.generate(1, 0)[0]
    assert task.check(e.x, ()) == task.check(e.x, ("=",)) == task.check(e.x, ("<pad>",) * 5)
    assert not task.check(e.x, ()).valid and not task.check(e.x, ()).answer_correct


# --- ties: the checker reports every strategy that writes the trace

def test_sorting_ties():
    t = Sorting.short()
    assert t.check((1, 2, 3, 4), t.render((1, 2, 3, 4), 0)).strategies == (0, 1, 2)
    assert t.check((1, 3, 2, 4), t.render((1, 3, 2, 4), 1)).strategies == (1, 2)
    assert t.check((1, 3, 2, 4), t.render((1, 3, 2, 4), 0)).strategies == (0,)


def test_grid_ties():
    t = GridPathfinding.small()
    line = grid_input(["S . . G", ". # . .", ". . . .", "# . . ."])
    assert t.check(line, t.render(line, 2)).strategies == (0, 1, 2)
    near = grid_input(["S . . .", ". . . .", ". . . .", ". G . ."])
    assert t.check(near, t.render(near, 1)).strategies == (1, 2) and t.check(near, t.render(near, 0)).strategies == (0,)


@pytest.mark.parametrize("task", [Sorting(tie_fraction=1.0), Sorting.short(tie_fraction=1.0), GridPathfinding(tie_fraction=1.0)],
                         ids=["sorting", "sorting_short", "grid"])
@given(seed=seeds)
def test_tie_inputs_report_every_tied_strategy(task, seed):
    for e in task.generate(3, seed):
        traces = renders(task, e.x)
        assert len(set(traces)) < len(traces)  # tie_fraction=1 draws only ties
        for y in set(traces):
            group = tuple(s for s, r in enumerate(traces) if r == y)
            assert task.check(e.x, y).strategies == group
        assert len(task.check(e.x, e.y).strategies) >= 1


@pytest.mark.parametrize("task", [Sorting(tie_fraction=0.0), GridPathfinding(tie_fraction=0.0), Addition(), Addition.short()],
                         ids=["sorting", "grid", "addition", "addition_short"])
@given(seed=seeds)
def test_no_ties_without_tie_fraction(task, seed):
    for e in task.generate(4, seed):
        assert task.check(e.x, e.y).strategies == (e.strategy,)


def test_addition_never_ties_on_two_digit_operands():
    t = Addition.short()
    for a in range(10, 100, 3):
        for b in range(10, 100):
            assert len(set(renders(t, addition_input(a, b)))) == 3


@pytest.mark.parametrize("task", [Sorting(), GridPathfinding()], ids=["sorting", "grid"])
def test_tie_rate_follows_tie_fraction(task):
    data = task.generate(2000, seed=11)
    rate = sum(len(set(renders(task, e.x))) < 3 for e in data) / len(data)
    assert abs(rate - task.tie_fraction) < 0.02


# --- the strategy is revealed early and is not a function of x

@new_tasks
def test_ideal_profile_is_the_strategy_code_length(task):
    for e in task.generate(200, 3):
        b, k = task.ideal_surprisal(e), len(task.check(e.x, e.y).strategies)
        assert len(b) == len(e.y) and all(v >= -1e-12 for v in b)
        assert math.isclose(sum(b), math.log(len(task.strategies) / k), abs_tol=1e-9)  # uniform prior, k tied writers
        assert task.oracle_surprisal(e) == [0.0] * len(e.y)
        if k == 1 and not isinstance(task, Addition):  # sampled untied inputs reveal within the first step
            assert max(t for t, v in enumerate(b) if v > 0) < (len(e.x) if isinstance(task, Sorting) else 8)


@new_tasks
def test_strategy_is_independent_of_the_input(task):
    data = task.generate(1500, seed=21)
    S = len(task.strategies)
    for bucket in (0, 1):  # split inputs by a feature of x; the strategy mix must not move
        group = [e for e in data if zlib.crc32(" ".join(map(str, e.x)).encode()) % 2 == bucket]
        for s in range(S):
            assert abs(sum(e.strategy == s for e in group) / len(group) - 1 / S) < 0.07
    assert all(task.strategy_prior(e.x) == [1 / S] * S for e in data[:20])


# --- seeds, configuration round trip, vocabulary, layout and export

@all_tasks
def test_generate_is_deterministic(task):
    assert task.generate(30, seed=5) == task.generate(30, seed=5) != task.generate(30, seed=6)


@all_tasks
def test_json_round_trip(task):
    d = json.loads(json.dumps(task.to_dict()))
    assert d["name"] == task.name and task_from_dict(d) == task


@all_tasks
def test_tokens_cover_every_input_and_response(task):
    assert not set(task.tokens) & set(SPECIALS) and len(set(task.tokens)) == len(task.tokens)
    v = Vocab.for_task(task)
    for e in task.generate(300, seed=8):
        ids = v.encode([str(t) for t in e.x] + list(e.y))
        assert v.decode(ids) == [str(t) for t in e.x] + list(e.y)


def test_presets_share_one_vocabulary():
    for family in ([Sorting(), Sorting.short(), Sorting.long()], [GridPathfinding(), GridPathfinding.small(), GridPathfinding.large()],
                   [Addition(), Addition.short(), Addition.long()]):
        assert len({t.tokens for t in family}) == 1


@new_tasks
def test_sequences_fit_the_layout(task):
    for e in task.generate(300, seed=9):
        assert len(layout_tokens(e, code="<z1>")) == len(e.x) + 4 + 3 + len(e.y) + 2 <= 96
        assert len(e.y) <= 60


def test_response_lengths():
    assert {len(e.y) for e in Sorting().generate(200, 0)} <= {5 ** 2 - 2, 6 ** 2 - 2}
    assert 15 <= min(len(e.y) for e in Addition().generate(500, 0))
    assert 15 <= min(len(e.y) for e in GridPathfinding(tie_fraction=0.0).generate(500, 0))


@new_tasks
def test_export_jsonl_writes_the_four_fields(task, tmp_path):
    data = task.generate(5, seed=1)
    export_jsonl(task, data, tmp_path / "d.jsonl")
    rows = [json.loads(l) for l in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    for r, e in zip(rows, data):
        assert set(r) == {"prompt", "response", "strategy", "answer"}
        assert r["prompt"].split() == [str(t) for t in e.x] and r["response"].split() == list(e.y)
        assert r["strategy"] == task.strategies[e.strategy] and r["answer"].split() == list(after_equals(e.y))


@pytest.mark.parametrize("make,bad,msg", [
    (Sorting, dict(max_digits=8), "min_digits"), (Sorting, dict(strategies=("bubble",)), "strategies"), (Sorting, dict(tie_fraction=2.0), "tie_fraction"),
    (GridPathfinding, dict(size=3), "size"), (GridPathfinding, dict(n_walls=-1), "n_walls"), (GridPathfinding, dict(strategies=("x", "y")), "strategies"),
    (Addition, dict(min_digits=1), "min_digits"), (Addition, dict(strategies=("place_value", "place_value")), "strategies"),
])
def test_invalid_knobs_are_refused(make, bad, msg):
    with pytest.raises(ValueError, match=msg): make(**bad)


def test_example_type():
    e = Addition().generate(1, 0)[0]
    assert isinstance(e, Example) and isinstance(e.x, tuple) and all(isinstance(t, str) for t in e.y)


def test_a_re_executed_task_definition_does_not_break_the_json_round_trip():
    "Documentation tools re-execute exported code; the second class they register must not change what task_from_dict returns."
    import basedirected.visiting_order as module
    from basedirected.tasks import task_from_dict
    task = module.VisitingOrder.late()
    exec(compile(open(module.__file__).read(), module.__file__, "exec"), {"__name__": module.__name__})
    assert task_from_dict(task.to_dict()) == task


# --- response entropy: surface forms ----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [Sorting, Addition], ids=["sorting", "addition"])
@pytest.mark.parametrize("forms", [1, 2, 4, 8])
def test_every_dressed_trace_reads_back_to_its_strategys_trace(make, forms):
    "For every level and strategy, a response written in surface forms is checked as its canonical trace: valid, that strategy's, answer right."
    import math
    import random
    task, rng = make(surface_forms=forms), random.Random(forms)
    for _ in range(60):
        x = task.sample_input(rng)
        for s in range(len(task.strategies)):
            y = task.render(x, s, rng)
            assert task.canonical(y) == task.render(x, s) and len(y) == len(task.render(x, s))  # the same positions, read back
            c = task.check(x, y)
            assert c.valid and s in c.strategies and c.answer_correct
            assert set(y) <= set(task.tokens) | {"="}
    e = task.generate(1, 3)[0]  # a perfect base pays log m on each of the task's own tokens, the strategy's surprisal unchanged
    own = [t in make().tokens for t in task.canonical(e.y)]
    assert task.oracle_surprisal(e) == [math.log(forms) if o and forms > 1 else 0.0 for o in own]
    plain = make().ideal_surprisal(type(e)(e.x, task.canonical(e.y), e.strategy))
    assert all(abs(a - (b + f)) < 1e-12 for a, b, f in zip(task.ideal_surprisal(e), plain, task.oracle_surprisal(e)))


def test_surface_forms_are_drawn_when_there_are_several_and_refused_when_bad():
    import random
    y = Sorting(surface_forms=4).render((5, 3, 9, 1, 0), 0, random.Random(0))
    assert any("~" in t for t in y) and Sorting(surface_forms=4).to_dict()["surface_forms"] == 4 and Sorting().to_dict()["surface_forms"] == 1
    assert Sorting().tokens == Sorting(surface_forms=1).tokens and len(Sorting(surface_forms=3).tokens) == 3 * len(Sorting().tokens)
    for bad in (0, 65, 2.0, True, "2"):
        with pytest.raises(ValueError, match="surface_forms must be an integer in \\[1, 64\\]"): Sorting(surface_forms=bad)
        with pytest.raises(ValueError, match="surface_forms must be an integer in \\[1, 64\\]"): Addition(surface_forms=bad)
    task = Sorting(surface_forms=2)  # a form the task does not have is no token of its trace
    x = (5, 3, 9, 1, 0)
    wrong = tuple(t + "~7" if i == 0 else t for i, t in enumerate(task.render(x, 0)))
    assert not task.check(x, wrong).valid


def test_the_tasks_pages_own_task_is_a_module_that_runs_at_its_documented_settings(tmp_path, monkeypatch):
    "The page's Mirror cell saved as mymodule.py passes check_task, draws the default splits of unseen inputs, and the page's command resolves to the reference run's configuration."
    import json
    import sys
    from pathlib import Path
    from basedirected.config import build_parser, config_from_args
    from basedirected.tasks import check_task, make_splits
    root = Path(__file__).resolve().parents[1]
    cells = ["".join(c["source"]) for c in json.loads((root / "nbs" / "05_tasks.ipynb").read_text())["cells"]]
    (cell,) = [c for c in cells if "class Mirror(Task):" in c]
    (tmp_path / "mymodule_page.py").write_text("from dataclasses import dataclass\n\nfrom basedirected.tasks import Task, TaskCheck\n\n\n" + cell + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    module = importlib.import_module("mymodule_page")
    try:
        check_task(module.Mirror())
        (page,) = [c for c in cells if c.startswith("**Running it.**")]
        command = page[page.index("basedirected-train"):page.index("\n", page.index("basedirected-train"))].split()
        reference = (root / "reference" / "own-task" / "command.txt").read_text().split()
        assert [a for a in command if not a.startswith("runs/")] == [a for a in reference if not a.startswith("/tmp/")]
        argv = [a.replace("mymodule:", "mymodule_page:") for a in command[1:]]
        config = config_from_args(build_parser().parse_args(argv))
        recorded = json.loads((root / "reference" / "own-task" / "config.json").read_text())["config"]
        assert json.loads(json.dumps(config.to_dict()["task"])) == recorded["task"] and config.cvae.K == 2 and config.base.steps == 3000 and config.train.steps == 800
        import re
        (minutes, seconds), = re.findall(r"^real\s+(\d+)m([\d.]+)s", (root / "reference" / "own-task" / "run.log").read_text(), re.M)
        assert 45 <= int(minutes) * 60 + float(seconds) <= 90 and "trains end to end in about a minute (`reference/own-task/`)" in (root / "README.md").read_text()
        assert f"it took {round(int(minutes) * 60 + float(seconds))} s by the shell's clock" in page
        from basedirected.cli import _verdict
        record = json.loads((root / "reference" / "own-task" / "metrics.json").read_text())
        assert _verdict(record, 2, 2) in (root / "reference" / "own-task" / "run.log").read_text()  # what the command printed is what it prints today
        train, held = make_splits(config.task, config.n_train, config.n_eval, config.data_seed)
        assert len(train) == config.n_train and not {e.x for e in train} & {e.x for e in held}
    finally:
        sys.modules.pop("mymodule_page", None)
        from basedirected.tasks import Task
        if getattr(Task.registry.get("mirror"), "__module__", None) == "mymodule_page": del Task.registry["mirror"]
