"""Each collection's README says how the collection was made; every figure it gives is read here from the file it comes from."""
import csv
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "reference"


def _readme(name: str) -> str:
    "A collection's README, whitespace collapsed."
    return " ".join((REF / name / "README.md").read_text().split())


def _minutes(name: str) -> float:
    from basedirected.repro import reference_minutes
    return reference_minutes(name)


def _revisions(name: str) -> tuple[dict, dict]:
    "The environment that trained a collection's runs (`preset.json`) and the one that collected them (`summary.json`)."
    return json.loads((REF / name / "preset.json").read_text())["environment"], json.loads((REF / name / "summary.json").read_text())["environment"]


@pytest.mark.parametrize("name, page", [("study", "13a_study"), ("followup", "13b_followup"), ("addition", "13c_addition"), ("settled", "13d_settled"),
                                        ("meaning", "13e_meaning"), ("entropy", "13f_entropy")])
def test_each_study_page_sends_its_lab_log_to_its_collections_readme(name, page):
    "The page names its README; the README has the section, names the page and what it reads."
    cells = json.loads((ROOT / "nbs" / f"{page}.ipynb").read_text())["cells"]
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert f"`reference/{name}/README.md`" in prose
    text = (REF / name / "README.md").read_text()
    assert "\n## How this collection was made\n" in text and f"nbs/{page}.ipynb" in text


def test_the_study_readme_is_its_sweep_log():
    text = _readme("study")
    summary = json.loads((REF / "study" / "summary.json").read_text())
    assert f"The sweep trained all {summary['runs']} runs in {_minutes('study'):.1f} minutes (`sweep.log`, the shell's `time`)" in text
    assert "ValueError: Unknown format code 'g'" in (REF / "study" / "sweep.log").read_text()  # it stopped while drawing a figure
    trained, collected = _revisions("study")
    assert not trained["git_dirty"] and not collected["git_dirty"] and trained["git_revision"] != collected["git_revision"]
    assert f"the revision that trained the runs ({trained['git_revision'][:7]}), `summary.json` the one that collected them ({collected['git_revision'][:7]})" in text
    assert (summary["jobs"], trained["cpu_count"]) == (2, 2) and "two worker processes on a 2-core machine" in text


def test_the_followup_readme_is_its_sweep_log():
    text = _readme("followup")
    log = (REF / "followup" / "sweep.log").read_text()
    invocations = re.findall(r"^# invocation (\d) \((\w+)", log, re.M)
    assert [i for i, _ in invocations] == ["1", "2", "3"] and "in three invocations from committed revisions" in text
    assert "shared the machine with test runs" in log.splitlines()[2] and "(the first invocation shared the machine with a test run)" in text
    assert f"{_minutes('followup'):.1f} minutes over the three invocations" in text
    trained, collected = _revisions("followup")
    assert trained["git_revision"].startswith(invocations[-1][1]) and not trained["git_dirty"] and not collected["git_dirty"]
    summary = json.loads((REF / "followup" / "summary.json").read_text())
    assert f"ran this preset's {summary['runs']} cells at {invocations[-1][1]}, the revision `preset.json` records" in text
    assert (trained["machine"], trained["cpu_count"]) == ("x86_64", 2) and "another 2-core x86_64 machine" in text


def test_the_addition_readme_is_its_sweep_log():
    text = _readme("addition")
    trained, collected = _revisions("addition")
    summary = json.loads((REF / "addition" / "summary.json").read_text())
    assert not trained["git_dirty"] and not collected["git_dirty"] and (summary["jobs"], trained["cpu_count"], trained["machine"]) == (2, 2, "x86_64")
    assert (f"trained its {summary['runs']} runs at {trained['git_revision'][:7]} (no uncommitted changes: `preset.json`) with two worker processes "
            f"on a 2-core x86_64 CPU, in {_minutes('addition'):.1f} minutes") in text
    assert "a CI run" in (REF / "addition" / "sweep.log").read_text() and "its base trained beside a CI run" in text


def test_the_settled_readme_is_its_sweep_log():
    text = _readme("settled")
    log = (REF / "settled" / "sweep.log").read_text()
    assert len(re.findall(r"^## invocation \d", log, re.M)) == 3 and f"Three invocations, {_minutes('settled'):.1f} minutes of sweep time" in text
    assert "invocation 1 from a clean worktree at daa5155, invocations 2 and 3 at 67af351" in log.splitlines()[0]
    trained, collected = _revisions("settled")
    assert trained["git_revision"].startswith("67af351") and not trained["git_dirty"] and not collected["git_dirty"]
    assert "the first from a clean worktree at daa5155, the second and third at 67af351, the revision `preset.json` records" in text
    assert "before any cell had run" in log and "before any CVAE had run" in text
    summary = json.loads((REF / "settled" / "summary.json").read_text())
    assert (summary["runs"], len(summary["missing"])) == (94, 18) and "94 of its 112 cells" in text and "names the 18 cells" in text
    trained2, _ = _revisions("settled-2")
    assert trained2["git_revision"].startswith("b6118a8") and "(bases at 67af351 and cells at b6118a8, against bases at daa5155 and cells at 67af351)" in text
    assert "## invocation 0: the two addition bases, trained at 67af351" in (REF / "settled-2" / "sweep.log").read_text()


def test_the_meaning_readme_counts_its_invocations_and_sittings():
    text = _readme("meaning")
    log = (REF / "meaning" / "sweep.log").read_text()
    numbered = sorted(set(re.findall(r"\binvocation (\d+)\b", log)))
    assert numbered == ["1", "2", "3", "4", "6"] and "a fifth invocation" in log and "was lost with the machine before it was collected" in log
    sittings = re.findall(r"^## sitting (\d)", log, re.M)  # sitting 1 opens the log without a heading; sitting 3 is the lost invocation's
    assert sittings == ["2", "3", "4"] and "nothing from it is used here" in log
    assert "The cells ran in five invocations in three sittings on one machine type (one more invocation, in a sitting between, was lost before it was collected" in text


def test_the_entropy_readme_is_its_sweep_log_and_its_presets_estimate():
    import inspect
    import basedirected.presets
    text = _readme("entropy")
    log = (REF / "entropy" / "sweep.log").read_text()
    assert len(re.findall(r"^invocation \d:", log, re.M)) == 5 and round(_minutes("entropy"), 1) == 180.7
    assert "about 2 hours on 2 cores" in inspect.getsource(basedirected.presets)
    assert f"it said about 2 hours on 2 cores; its five invocations took {_minutes('entropy'):.1f} minutes (`sweep.log`)" in text
    trained, collected = _revisions("entropy")
    summary = json.loads((REF / "entropy" / "summary.json").read_text())
    assert summary["revisions"] == [trained["git_revision"]] and not trained["git_dirty"] and not collected["git_dirty"]  # one clean revision
    assert "Intel" in trained["cpu"] and "Xeon" in trained["cpu"] and trained["cpu_count"] == 2 and summary["cpus"] == [trained["cpu"]]
    assert "Every run is from one clean revision on one 2-core Intel Xeon" in text


def test_the_base_profiles_readme_says_what_its_csv_holds():
    import csv
    rows = {r["base"]: {k: float(v) for k, v in r.items() if k not in ("base", "task")} for r in csv.DictReader(open(REF / "base-profiles" / "profiles.csv"))}
    from basedirected.pretrained import catalogue
    assert set(rows) == set(catalogue())  # every shipped base
    text = _readme("base-profiles")
    task_bases = [r for name, r in rows.items() if not name.startswith("visiting_order")]
    assert len(task_bases) == 6 and "the six bases" in text
    lo, hi = min(r["b_top10_share"] for r in task_bases), max(r["b_top10_share"] for r in task_bases)
    assert f"{lo:.3f} to {hi:.3f}" in text
    assert f"CV {min(r['b_cv'] for r in task_bases):.2f} to {max(r['b_cv'] for r in task_bases):.2f}" in text
    vo = rows["visiting_order-early-s0"]
    assert f"{vo['b_top10_share']:.3f} (CV {vo['b_cv']:.2f})" in text
    (minutes, seconds), = re.findall(r"^real\s+(\d+)m([\d.]+)s", (REF / "base-profiles" / "run.log").read_text(), re.M)
    assert all(r["n_eval"] == 512 for r in rows.values()) and f"in {60 * int(minutes) + float(seconds):.1f} s by the shell's `time`" in text


def test_austen_sorting_readme_is_its_files():
    "The first runs on a language model as the base: every figure of the table, and the revision, read from the run's files."
    d, text = REF / "austen-sorting", _readme("austen-sorting")
    row = {}
    for name, run in (("trial", d / "trial-1000-steps"), ("run", d)):
        g, m = json.loads((run / "base_gate.json").read_text()), json.loads((run / "metrics.json").read_text())
        c = json.loads((run / "reference_scale.json").read_text())["model"]["value"]
        row[name] = [f"{g['valid_rate']:.3f}", f"{g['answer_only_accuracy']:.3f}", f"{g['strategy_gap']:.3f}", f"{g['surprisal_excess']:.0%}".replace("%", " %"),
                     f"{c:.3f}", f"{m['base_b_cv']:.2f} / {m['base_b_top10_share']:.3f}", f"{m['rate']:.2f}", f"{m['I_zs_given_x_norm']:.2f}",
                     f"{m['gen_alignment_controlled_all']:.1%} ({m['gen_alignment_controlled_all_null']:.1%})".replace("%", " %")]
        assert not g["passes"] and m["gate_passes"] == 0.0
    for a, b in zip(row["trial"], row["run"]): assert f"| {a} | {b} |" in text, (a, b)
    m = json.loads((d / "metrics.json").read_text())
    assert m["git_revision"].startswith("72f3088") and not m["git_dirty"] and m["settled"] is False and "| yes | no: still moving at its last step |" in text
    assert json.loads((d / "trial-1000-steps" / "metrics.json").read_text())["settled"] is True
    assert json.loads((d / "fine_tune.json").read_text())["key"]["fine_tune"]["steps"] == 4000 and "--fine-tune-steps 4000 --n-train 8192" in (d / "command.txt").read_text()
    assert re.search(r"in 1,516 s", text) and "1515.89 s wall" in (d / "run.log").read_text()
    findings = (ROOT / "nbs" / "13_findings.ipynb").read_text()
    g = json.loads((d / "base_gate.json").read_text())
    assert f"valid traces {g['valid_rate']:.3f} after 4,000 steps" in findings and f"({m['base_b_top10_share']:.3f} of it on the top tenth of the tokens)" in findings
    guide = (ROOT / "nbs" / "15_guide.ipynb").read_text()
    trial = json.loads((d / "trial-1000-steps" / "base_gate.json").read_text())
    assert f"after 1,000 steps on 2,048 examples (valid traces {trial['valid_rate']:.3f}) and after 4,000 steps on 8,192 (valid traces {g['valid_rate']:.3f}, answers {g['answer_only_accuracy']:.3f})" in guide


def narrated_rows(profile: dict) -> list[str]:
    "The rows of austen-narrated's table, from its profile.json."
    b, a = profile["before_fine_tuning"], profile["after_fine_tuning"]
    rows = [("mean $b_t$ (nats)", "b_mean", "{:.2f}"), ("CV of $b_t$", "b_cv", "{:.2f}"), ("share on the top 10 % of tokens", "b_top10_share", "{:.3f}"),
            ("mean $b_t$ on the trace's tokens", "mean_b_trace", "{:.2f}"), ("mean $b_t$ on the narration's tokens", "mean_b_narration", "{:.2f}"),
            ("the trace's share of the total", "trace_share_of_total", "{:.3f}")]
    return [f"| {name} | {f.format(b[k])} | {f.format(a[k])} |" for name, k, f in rows]


def test_austen_narrated_readme_is_its_files():
    "The narrated base's table, token counts and provenance, read from profile.json and tokens.csv."
    import csv
    d, text = REF / "austen-narrated", _readme("austen-narrated")
    profile = json.loads((d / "profile.json").read_text())
    for row in narrated_rows(profile): assert row in text, row
    tokens = list(csv.DictReader(open(d / "tokens.csv")))
    assert len(tokens) == profile["after_fine_tuning"]["trace_tokens"] + profile["after_fine_tuning"]["narration_tokens"]
    assert sum(r["kind"] == "trace" for r in tokens) == profile["after_fine_tuning"]["trace_tokens"]
    assert not profile["made"]["dirty"] and profile["steps"] == 2000 and profile["n_train"] == 2048 and profile["n_eval"] == 128
    s, a = profile["seconds"], profile["after_fine_tuning"]
    assert f"Made from {profile['made']['revision'][:7]}" in text and f"in {s['total']} s ({s['narration']} s sampling the narration, {s['fine_tuning']} s fine-tuning)" in text
    assert f"({len(tokens):,}: {a['trace_tokens']:,} of the trace, {a['narration_tokens']:,} of the" in text
    findings = (ROOT / "nbs" / "13_findings.ipynb").read_text()
    assert f"top-10 % share {a['b_top10_share']:.3f}, the trace's tokens {a['trace_share_of_total']:.3f} of the total; one base, not gated" in findings


def test_english_lm_retrain_readme_is_its_files():
    "Retraining austen-gpt2 from its script on the same CPU type gave the shipped weights, byte for byte."
    d, text = REF / "english-lm-retrain", _readme("english-lm-retrain")
    shipped = json.loads((ROOT / "basedirected" / "lms" / "catalogue.json").read_text())["lms"][0]
    assert shipped["name"] == "austen-gpt2" and (d / "model.safetensors.sha256").read_text().strip() == shipped["sha256"]["model.safetensors"]
    again = json.loads((d / "english_lm.json").read_text())
    recorded = json.loads((ROOT / "basedirected" / "lms" / "austen-gpt2" / "english_lm.json").read_text())
    assert again["heldout"] == recorded["heldout"] and again["made"]["cpu"] == recorded["made"]["cpu"] and again["made"]["revision"].startswith("4aed6e0")
    assert f"took {again['seconds']} s" in text and f"the shipped record says {recorded['seconds']} s" in text
    assert "held-out perplexity: 81.916 here, 81.916 recorded for austen-gpt2 (ratio 1.0000)" in (d / "run.log").read_text()


def test_base_profiles_of_the_collections_readme_is_its_files():
    "The collections' own bases: the surface-form levels nearly flat, the others in the one-form corner, five of them the shipped bases byte for byte."
    import hashlib
    rows = {r["base"]: {k: float(v) for k, v in r.items() if k not in ("base", "task")} for r in csv.DictReader(open(REF / "base-profiles" / "collections.csv"))}
    kept = sorted(f"{d.parent.parent.name}/{d.name}" for c in ("entropy", "meaning", "settled-2") for d in (REF / c / "bases").iterdir() if (d / "base.pt").is_file())
    assert sorted(rows) == kept and len(kept) == 12
    text, span = _readme("base-profiles"), lambda key, names, f: f"{f.format(min(rows[n][key] for n in names))}–{f.format(max(rows[n][key] for n in names))}"
    for m, (mean, cv, share) in {2: ("0.686–0.687", "0.38–0.39", "0.163–0.165"), 4: ("1.336–1.339", None, "0.139–0.141")}.items():
        names = [n for n in rows if f"forms{m}" in n]
        assert len(names) == 3 and span("b_mean", names, "{:.3f}") == mean and span("b_top10_share", names, "{:.3f}") == share
        assert cv is None and all(round(rows[n]["b_cv"], 2) == 0.31 for n in names) or span("b_cv", names, "{:.2f}") == cv
    one_form = [n for n in rows if "forms" not in n]
    assert span("b_cv", one_form, "{:.2f}") == "3.73–4.95" and span("b_top10_share", one_form, "{:.3f}") == "0.997–1.000" and "CV 3.73–4.95, share 0.997–1.000" in text
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    same = [n for n in one_form if sha(REF / n.split("/")[0] / "bases" / n.split("/")[1] / "base.pt") == sha(ROOT / "basedirected" / "bases" / n.split("/")[1] / "base.pt")]
    assert sorted(set(one_form) - set(same)) == ["settled-2/addition-s0"] and len(same) == 5
    assert "CV 4.90 against the shipped one's 4.92" in text and round(rows["settled-2/addition-s0"]["b_cv"], 2) == 4.90
    shipped = next(r for r in csv.DictReader(open(REF / "base-profiles" / "profiles.csv")) if r["base"] == "addition-s0")
    assert round(float(shipped["b_cv"]), 2) == 4.92
    (minutes, seconds), = re.findall(r"^real\s+(\d+)m([\d.]+)s", (REF / "base-profiles" / "collections.log").read_text(), re.M)
    assert f"in {60 * int(minutes) + float(seconds):.1f} s by the shell's `time`" in text and "clean worktree at 8a766b8" in text


def test_austen_narrated_gate_readme_is_its_files():
    "A narrated base through the run option fails the gate, with the figures its README gives."
    d, text = REF / "austen-narrated-gate", _readme("austen-narrated-gate")
    g = json.loads((d / "base_gate.json").read_text())
    assert not g["passes"] and g["n_inputs"] == 256 and g["valid_rate_n"] == 1024 and g["ideal_per_token"] is None and g["base"]["narration"] == "austen-gpt2"
    assert f"| valid traces | {g['valid_rate']:.3f} ({g['valid_rate_lo']:.3f}–{g['valid_rate_hi']:.3f}) | ≥ 0.95 |" in text
    assert f"| answers right | {g['answer_only_accuracy']:.3f} ({g['answer_only_accuracy_lo']:.3f}–{g['answer_only_accuracy_hi']:.3f}) | ≥ 0.98 |" in text
    assert f"| strategy frequencies off by | {g['strategy_gap']:.3f} (bubble {g['strategy_frequencies'][0]:.3f} against 1/3) | ≤ 0.05 |" in text
    assert g["valid_rate"] < 0.5 and g["answer_only_accuracy"] < 0.9  # the prediction's figures
    findings = (ROOT / "nbs" / "13_findings.ipynb").read_text()
    assert f"valid traces {g['valid_rate']:.3f}, answers right {g['answer_only_accuracy']:.3f} over {g['valid_rate_n']:,} samples; one base" in findings
    config = json.loads((d / "config.json").read_text())["config"]
    assert config["narration"] == "austen-gpt2" and config["fine_tune"]["steps"] == 2000 and len(json.loads((d / "fine_tune.json").read_text())["losses"]) == 2000
    assert "valid 7, answer right 42" in (d / "diagnosis.log").read_text() and "7 valid traces and 42 right answers, and only 4 samples" in text
    assert "with a word that mixes a digit, | or = into other characters (read as narration, so a step of the trace is lost): 4" in (d / "diagnosis.log").read_text()
    log = (d / "run.log").read_text()
    assert "real\t12m43.061s" in log and "2000/2000 [11:12<" in log and "12 min 43 s" in text and "took 11 min 12 s" in text and "clean worktree at da75ba8" in text


def test_austen_narrated_gate_2_readme_is_its_files():
    "The second narrated base (four times the data, three times the steps) fails the gate by less, with the figures its README gives."
    d, text = REF / "austen-narrated-gate-2", _readme("austen-narrated-gate-2")
    g, first = (json.loads((REF / n / "base_gate.json").read_text()) for n in ("austen-narrated-gate-2", "austen-narrated-gate"))
    assert not g["passes"] and g["n_inputs"] == 256 and g["valid_rate_n"] == 1024 and g["ideal_per_token"] is None and g["base"]["narration"] == "austen-gpt2"
    assert g["base"]["n_train"] == 8192 and g["base"]["fine_tune"]["steps"] == 6000
    rate = lambda r, k: f"{r[k]:.3f} ({r[k + '_lo']:.3f}–{r[k + '_hi']:.3f})"
    assert f"| valid traces | {rate(first, 'valid_rate')} | {rate(g, 'valid_rate')} | ≥ 0.95 |" in text
    assert f"| answers right | {rate(first, 'answer_only_accuracy')} | {rate(g, 'answer_only_accuracy')} | ≥ 0.98 |" in text
    assert f"| strategy frequencies off by | {first['strategy_gap']:.3f} | {g['strategy_gap']:.3f} | ≤ 0.05 |" in text
    assert 0.3 < g["valid_rate"] < 0.9 and 0.85 < g["answer_only_accuracy"] < 0.98 and g["strategy_gap"] <= 0.05  # the prediction's ranges
    tail = lambda n: sum(json.loads((REF / n / "fine_tune.json").read_text())["losses"][-100:]) / 100
    assert f"({tail('austen-narrated-gate-2'):.2f} against {tail('austen-narrated-gate'):.2f} nats per token" in text
    assert len(json.loads((d / "fine_tune.json").read_text())["losses"]) == 6000
    log = (d / "run.log").read_text()
    assert "6000/6000 [36:01<" in log and "exit 2 after 2410 s" in log and "2,410 s in all" in text and "took 36 min 1 s" in text
    assert "clean worktree at f892dc2" in text
    findings = (ROOT / "nbs" / "13_findings.ipynb").read_text()
    assert f"valid traces {g['valid_rate']:.3f}, answers right {g['answer_only_accuracy']:.3f}, with 8,192 examples and 6,000 steps" in findings
    assert f"(valid traces {first['valid_rate']:.3f} and {g['valid_rate']:.3f})" in (REF / "README.md").read_text()
