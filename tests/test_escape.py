"""Time to escape and the one definition of each word: the escape time's laws on any curve, the restricted mean against
lifelines, finding 9 recomputed from the committed collections, every count of "names" through `code_verdict`, every
report's interval through the rule, and the sentences the pages no longer say."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from basedirected.comparisons import code_verdict, contrast_interval, interval_call, resolved, verdict_counts
from basedirected.escape import ESCAPE_RATE, escape_contrasts, escape_observation, escape_records, escape_step, kaplan_meier

ROOT = Path(__file__).resolve().parents[1]


@given(rates=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=12), threshold=st.floats(0.05, 1.5))
def test_the_escape_step_is_the_start_of_the_last_run_above_the_threshold(rates, threshold):
    curve = [(70 * (i + 1), r) for i, r in enumerate(rates)]
    step = escape_step(curve, threshold)
    if rates[-1] < threshold:
        assert step is None and escape_observation(curve, threshold)["escaped"] is False
        return
    i = [s for s, _ in curve].index(step)
    assert all(r >= threshold for r in rates[i:]) and (i == 0 or rates[i - 1] < threshold)  # stays above from there; below just before
    obs = escape_observation(curve, threshold)
    assert obs["escaped"] and obs["escape_step"] == step <= obs["escape_budget"] == curve[-1][0] and obs["escape_resolution"] == 70


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.integers(1, 12), min_size=1, max_size=20))
def test_censored_only_at_the_budget_the_restricted_mean_is_the_plain_mean(steps):
    "Two computations: lifelines' integral of the Kaplan-Meier curve and the mean of min(t, T)."
    T = 700
    times = [min(70 * s, T) for s in steps]
    escaped = [70 * s <= T for s in steps]
    km = kaplan_meier(times, escaped, T)
    assert km["rmet"] == pytest.approx(sum(times) / len(times), rel=1e-9)
    assert (km["median"] is None) == (sum(escaped) < len(times) / 2 or sorted(t for t, e in zip(times, escaped) if e)[math.ceil(len(times) / 2) - 1:] == [])


def test_an_escape_contrast_is_the_rule_on_restricted_times_and_refuses_unequal_budgets():
    def run(objective, base, seed, step, budget=700):
        return {"regime": "sorting", "latent": "discrete", "posterior": "exact", "K": 3, "objective": objective, "alpha": 0.5, "gamma": 1.0,
                "tau_target": 0.07, "base_seed": base, "seed": seed, "key": f"{objective}{base}{seed}", "escape_step": min(step, budget),
                "escaped": step <= budget, "escape_budget": budget}
    times = {(b, s): 70 * (1 + (3 * b + s) % 5) for b in range(3) for s in range(3)}
    records = [run("celbo", b, s, t) for (b, s), t in times.items()] + [run("theta", b, s, t - 70 * (s % 2)) for (b, s), t in times.items()]
    (row,) = escape_contrasts(records)
    by_base = {b: [-70.0 * (s % 2) for s in range(3)] for b in range(3)}
    rule = contrast_interval(by_base)
    assert (row["mean"], row["lo"], row["hi"], row["rule"]) == (rule["mean"], rule["lo"], rule["hi"], rule["rule"])
    assert (row["earlier"], row["later"], row["ties"]) == (3, 0, 6)
    records[-1] = run("theta", 2, 2, 140, budget=800)
    with pytest.raises(ValueError, match="one budget"): escape_contrasts(records)


def test_finding_9_recomputes_from_the_collections():
    "At the threshold fixed before reading, the sorting runs of settled and entropy escape by their second evaluation and no escape contrast is resolved."
    assert ESCAPE_RATE == 0.5
    escape = {name: escape_records(ROOT / "reference" / name) for name in ("settled", "settled-2", "entropy")}
    sorting = [r for name in ("settled", "entropy") for r in escape[name] if r["regime"] == "sorting" and r.get("tau_target") is not None]
    assert len(sorting) == 252 and sum(r["escaped"] and r["escape_step"] == 70 for r in sorting) == 230 and all(r["escaped"] and r["escape_step"] <= 140 for r in sorting)
    rows = [r for recs in escape.values() for r in escape_contrasts(recs)]
    assert rows and not any(resolved(r) for r in rows if math.isfinite(r["lo"]))
    late = {(r["cell"], r["comparison"]): r for r in escape_contrasts(escape_records(ROOT / "reference" / "entropy", threshold=1.0))}
    strong = late[("tau 0.07 forms 2", "theta(a=0.2,g=2) - celbo")]
    assert (strong["earlier"], strong["later"]) == (12, 0) and interval_call(strong["lo"], strong["hi"]) == "unresolved"


def test_every_count_of_names_goes_through_code_verdict(monkeypatch):
    "verdict_counts calls code_verdict on each record, and no page or test defines the word again with its own thresholds."
    import basedirected.comparisons as comparisons
    calls = []
    real = comparisons.code_verdict
    monkeypatch.setattr(comparisons, "code_verdict", lambda r, *a: calls.append(r) or real(r, *a))
    records = [{"I_zs_given_x_norm": 0.9, "K": 3, "gen_alignment_controlled": a} for a in (0.95, 0.85, 0.5)]
    assert comparisons.verdict_counts(records) == {"names": 1, "relabels": 1, "between": 1, "merges": 0, "unjudged": 0} and calls == records
    own = re.compile(r"I_zs_given_x_norm\W*\]?\s*(>=|<)\s*0\.85[^\n]*(>=|<)\s*0\.(9|8)\b|judged\(r\)\s*>=\s*0\.9")
    sources = {p.name: "".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code") for p in sorted((ROOT / "nbs").glob("13*.ipynb"))}
    sources.update({p.name: p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name != "test_escape.py"})
    assert not [name for name, src in sources.items() if own.search(src)], "a page or test defines 'names the strategy' with its own thresholds"
    for page in ("13_findings.ipynb", "13e_meaning.ipynb", "13f_entropy.ipynb"):
        assert re.search(r"\b(names_strategy|code_verdict|verdict_counts)\b", sources[page]), page


def test_reports_print_the_rules_intervals_and_say_what_else_they_show():
    from basedirected.reports import CONTRASTS_HEADER, STATS_HEADER, base_contrasts, contrasts_markdown, paired_statistics, stats_markdown
    rng = np.random.default_rng(3)
    records = []
    for base in range(3):
        for seed in range(3):
            for objective, shift in (("theta", 0.1), ("dist", 0.0)):
                records.append({"regime": "sorting", "latent": "discrete", "posterior": "exact", "K": 3, "objective": objective, "alpha": 0.5, "gamma": 1.0,
                                "tau_target": 0.07, "base_seed": base, "seed": seed, "settled": not (objective == "dist" and base == 2 and seed == 0),
                                "gen_alignment_controlled_all_excess": 0.5 + shift + 0.1 * base + float(rng.normal(0, 0.02))})
    (s,) = paired_statistics(records, metrics=("gen_alignment_controlled_all_excess",))
    (c,) = base_contrasts(records, metrics=("gen_alignment_controlled_all_excess",))
    assert (s["ci_lo"], s["ci_hi"], s["rule"]) == (c["lo"], c["hi"], c["rule"]) and s["unsettled_left_out"] == c["unsettled_left_out"] == 1
    assert c["n_all"] == c["n"] + 1 and math.isfinite(c["lo_all"])
    assert stats_markdown([s]).startswith(STATS_HEADER) and "the rule" in stats_markdown([s])
    md = contrasts_markdown([c])
    assert md.startswith(CONTRASTS_HEADER) and "not the rule" in md and "every run kept" in md and f"{c['mean_all']:+.3f}" in md


@pytest.mark.parametrize("page, sentence", [
    ("nbs/13f_entropy.ipynb", "nothing separates"),
    ("nbs/13f_entropy.ipynb", "its other 4 labelled apart"),
    ("nbs/13_findings.ipynb", "findings 1 and 2 hold"),
    ("nbs/13_findings.ipynb", "Finding 1 holds"),
    ("nbs/13_findings.ipynb", "Finding 2 holds"),
    ("nbs/13_findings.ipynb", "about as much as across seeds"),
    ("nbs/13_findings.ipynb", "does not carry over"),
    ("README.md", "does not carry over"),
])
def test_the_pages_no_longer_say(page, sentence):
    path = ROOT / page
    text = path.read_text() if path.suffix == ".md" else "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    assert sentence not in " ".join(text.split()), f"{page} still says {sentence!r}"


def test_a_resolved_m1_contrast_says_what_is_resolved():
    "Page 13f's resolved J_theta - cELBO at m = 1 is said to be validity, not meaning, where it is stated."
    cells = json.loads((ROOT / "nbs" / "13f_entropy.ipynb").read_text())["cells"]
    text = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())
    i = text.index("resolved, small, on three bases")
    assert "What is resolved is validity, not meaning" in text[i:i + 600]


@pytest.mark.parametrize("collection", ["settled", "settled-2", "entropy", "shortcut-addition"])
def test_a_collections_statistics_are_what_the_reports_write_today(collection, tmp_path):
    "The committed stats.md and contrasts.md of every collection with several bases per task are the one rule's, as write_statistics writes them from results.csv now."
    from basedirected.cluster import read_records
    from basedirected.reports import write_statistics
    ref = ROOT / "reference" / collection
    write_statistics(tmp_path, read_records(ref))
    for name in ("stats.md", "contrasts.md"):
        if (ref / name).is_file() or (tmp_path / name).is_file():
            assert (tmp_path / name).read_text() == (ref / name).read_text(), f"{collection}/{name} was not written by today's rule"


@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_an_early_grid_resolves_the_escape_to_its_own_period(early_parts, periods, data):
    "With `eval_early_every`, an escape inside the first period is known to one early step, read from the run's own grid."
    from basedirected.config import TrainConfig
    every = 10 * early_parts
    tc = TrainConfig(steps=every * periods, eval_every=every, eval_early_every=every // early_parts, warmup_steps=1)
    grid = tc.evaluation_steps()
    assert grid[:early_parts] == [every // early_parts * (i + 1) for i in range(early_parts)] and grid[-1] == tc.steps
    escape = data.draw(st.sampled_from(grid))
    o = escape_observation([(s, 1.0 if s >= escape else 0.0) for s in grid])
    assert o["escape_step"] == escape and o["escape_resolution"] == escape - max([0] + [s for s in grid if s < escape])
    if escape <= every: assert o["escape_resolution"] == every // early_parts
