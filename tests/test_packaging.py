"""The package's own hygiene: dependency lists agree, modules match their notebooks, imports stay light."""
import configparser
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _settings():
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(ROOT / "settings.ini")
    return cfg["DEFAULT"]


def _environment_pip_requirements():
    lines, inside = [], False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.strip()
        if stripped == "- pip:":
            inside = True
            continue
        if inside and stripped.startswith("- "):
            item = stripped[2:].strip()
            if item != "-e .":
                lines.append(item)
    return lines


def test_environment_yml_lists_exactly_the_settings_requirements():
    s = _settings()
    wanted = shlex.split(s["requirements"]) + shlex.split(s["dev_requirements"])
    assert sorted(_environment_pip_requirements()) == sorted(wanted)


def test_nbdev_pins_are_in_dev_requirements():
    dev = shlex.split(_settings()["dev_requirements"])
    for pin in ("nbdev==2.4.14", "execnb>=0.1.12,<0.2", "fastcore>=1.12.3,<1.13", "ghapi>=1.0.3,<2"):
        assert pin in dev


def test_exported_modules_do_not_import_nbdev():
    code = "import sys, basedirected, pkgutil, importlib\n" \
           "[importlib.import_module('basedirected.' + m.name) for m in pkgutil.iter_modules(basedirected.__path__)]\n" \
           "bad = [m for m in sys.modules if m.split('.')[0] in ('nbdev', 'execnb', 'IPython', 'fastcore')]\n" \
           "assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_package_imports_without_its_optional_extras():
    "submitit (the [cluster] extra) is imported only when a job is submitted; without it every module imports and the sweep runs in a pool."
    code = "import sys; sys.modules['submitit'] = None\n" \
           "import basedirected, pkgutil, importlib\n" \
           "[importlib.import_module('basedirected.' + m.name) for m in pkgutil.iter_modules(basedirected.__path__) if m.name != 'hf']\n" \
           "from basedirected.cluster import ClusterConfig, ClusterError, resolve_cluster\n" \
           "try: resolve_cluster(ClusterConfig(executor='submitit')); raise SystemExit('no error')\n" \
           "except ClusterError as e: assert 'pip install -e \".[cluster]\"' in str(e), e"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_modules_are_in_sync_with_notebooks(tmp_path):
    nbdev_export = shutil.which("nbdev_export") or str(Path(sys.executable).parent / "nbdev_export")
    if not Path(nbdev_export).exists():
        pytest.skip("nbdev_export is not installed")
    shutil.copytree(ROOT / "nbs", tmp_path / "nbs", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (tmp_path / "basedirected").mkdir()  # from nothing: a module no notebook exports is an orphan
    for name in ("settings.ini", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    subprocess.run([nbdev_export], cwd=tmp_path, check=True, capture_output=True)
    for py in sorted((ROOT / "basedirected").glob("*.py")):
        assert (tmp_path / "basedirected" / py.name).read_text() == py.read_text(), f"{py.name} is out of sync with nbs/: run nbdev_export"
    exported = {p.name for p in (tmp_path / "basedirected").glob("*.py")}
    committed = {p.name for p in (ROOT / "basedirected").glob("*.py")}
    assert committed == exported, f"orphan modules {committed - exported}, missing modules {exported - committed}"


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```sh\n")[1:3]
    return [b.split("\n```")[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    main_cmd, test_cmd = _readme_commands()
    assert "pip install torch==2.13.0" in main_cmd and "pip install torch==2.13.0" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_readme_and_index_show_the_same_commands():
    import json
    nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for cmd in _readme_commands():
        assert cmd in text, f"nbs/index.ipynb lacks the README command: {cmd}"


def test_quarto_sidebar_lists_every_published_notebook_in_order():
    from basedirected.docsite import page_order
    from basedirected.docsite import page_section
    lines = [l.strip()[2:] for l in (ROOT / "nbs" / "sidebar.yml").read_text().splitlines() if l.strip().startswith("- ")]
    listed = [l for l in lines if not l.startswith("section:")]
    assert listed == [p.name for p in page_order(ROOT / "nbs")]
    # in the docs site's sections, each heading once, before its first page
    sections = [l.split(":", 1)[1].strip().strip('"') for l in lines if l.startswith("section:")]
    assert sections == list(dict.fromkeys(s for p in page_order(ROOT / "nbs") if (s := page_section(p.stem + ".html"))))


def _reading_order():
    "Module names in notebook order (each notebook's `#| default_exp`)."
    import json
    from basedirected.docsite import page_order
    mods = []
    for nb in page_order(ROOT / "nbs"):
        for c in json.loads(nb.read_text())["cells"]:
            src = "".join(c["source"])
            if c["cell_type"] == "code" and src.startswith("#| default_exp"):
                mods.append(src.split()[2]); break
    return mods


def _package_imports(mod: str) -> set[str]:
    "The package's modules `mod` imports, in any form: `from .x import`, `import basedirected.x`, and `importlib.import_module('basedirected.x')` with a literal name, at the top or inside a function."
    import ast
    found = set()
    for node in ast.walk(ast.parse((ROOT / "basedirected" / f"{mod}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and (node.level or node.module.startswith("basedirected.")):
            found.add(node.module.removeprefix("basedirected.").lstrip("."))
        elif isinstance(node, ast.ImportFrom) and node.module == "basedirected":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("basedirected.")}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("basedirected."):
            found.add(node.args[0].value.split(".")[1])
    return found


def test_no_module_imports_from_a_module_above_it():
    order = _reading_order()
    assert len(order) == len(set(order)) and "objective" in order and "reports" in order
    for i, mod in enumerate(order):
        for name in _package_imports(mod) & set(order):
            assert order.index(name) < i, f"{mod} (notebook {i}) imports {name}, which comes later in the reading order"


def test_the_reports_stand_on_the_collection_not_on_the_runner_or_the_executor():
    "A collection's files are named once (`basedirected.collection`); the reports read them there, in any form of import."
    found = _package_imports("reports")
    assert "collection" in found and not found & {"experiments", "cluster", "repro"}, found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    "The first import circle of `graph` (module -> modules it imports), as a path that returns to its start; None if there is none."
    def walk(path):
        for name in sorted(graph.get(path[-1], ())):
            if name in path: return [*path[path.index(name):], name]
            if (found := walk([*path, name])): return found
    return next((c for mod in sorted(graph) if (c := walk([mod]))), None)


def test_the_package_has_no_import_circle():
    "Whatever the reading order says: no module reaches itself through the modules it imports (lazily or not)."
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"] and _circle({"a": {"b"}, "b": set()}) is None
    assert _circle({mod: _package_imports(mod) for mod in _reading_order()}) is None


def _mixes_imports_with_code(source: str) -> bool:
    "nbdev's documentation build runs every cell that imports, in a kernel holding only imports and exports: such a cell must do nothing else."
    import ast
    code = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("#|", "%", "!")))
    try: tree = ast.parse(code)
    except SyntaxError: return False
    nodes = list(ast.walk(tree))
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in nodes) and any(isinstance(n, (ast.Expr, ast.Assign)) for n in nodes)


def test_no_notebook_cell_mixes_imports_with_other_code():
    import json
    from basedirected.docsite import page_order
    assert _mixes_imports_with_code("import re\nx = re.compile('a')") and not _mixes_imports_with_code("import re\nfrom math import pi")
    found = []
    for nb in page_order(ROOT / "nbs"):
        for i, c in enumerate(json.loads(nb.read_text())["cells"]):
            src = "".join(c["source"])
            exported = any(l.strip().split()[1:2] in (["export"], ["exports"], ["exporti"], ["exec_doc"]) for l in src.splitlines() if l.startswith("#|"))
            if c["cell_type"] == "code" and not exported and _mixes_imports_with_code(src): found.append(f"{nb.name} cell {i}: {src.splitlines()[0]}")
    assert not found, "cells the documentation build would run without the cells before them (put their imports in a cell of their own):\n" + "\n".join(found)


MAX_CELL_LINES = 50  # a code cell is read beside its prose: one screen


def test_no_notebook_code_cell_is_longer_than_a_screen():
    import json
    from basedirected.docsite import page_order
    long = [f"{nb.name} cell {c.get('id')}: {n} lines ({''.join(c['source']).splitlines()[1][:60]!r})"
            for nb in page_order(ROOT / "nbs") for c in json.loads(nb.read_text())["cells"]
            if c["cell_type"] == "code" and (n := len("".join(c["source"]).splitlines())) > MAX_CELL_LINES]
    assert not long, f"code cells over {MAX_CELL_LINES} lines (split them where the code has a seam):\n" + "\n".join(long)


def test_the_cpu_environment_is_the_environment_with_cpu_wheels():
    lines = lambda name: [l.strip() for l in (ROOT / name).read_text().splitlines() if l.strip().startswith("- ")]
    cpu, full = lines("environment-cpu.yml"), lines("environment.yml")
    assert "- --extra-index-url https://download.pytorch.org/whl/cpu" in cpu
    assert [l for l in cpu if "--extra-index-url" not in l] == full


def _imported_distributions(modules):
    "Top-level third-party modules that `modules` import at run time (module level or inside functions)."
    import ast
    mods = set()
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import): mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module: mods.add(node.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m not in ("basedirected", "__future__")}


def test_requirements_are_what_the_package_imports():
    "Every third-party module the package imports is declared (a core requirement or its extra), and no core requirement goes unused."
    s = _settings()
    name = lambda req: req.split(">")[0].split("=")[0].split("<")[0].lower()
    core = {name(r) for r in shlex.split(s["requirements"])}
    extras = {name(r) for key in ("hf_requirements", "cluster_requirements") for r in shlex.split(s[key])}
    module_of = {"pyyaml": "yaml"}
    imported = _imported_distributions(sorted((ROOT / "basedirected").glob("*.py")))
    doc_build = {"nbformat", "nbclient", "nbconvert", "nbdev", "execnb", "fastcore", "traitlets"}  # basedirected-docs: the [dev] tools (traitlets is nbconvert's)
    with_an_extra = {"tokenizers"}  # transformers' own tokenizers (the [hf] extra), for the tiny test backbone
    declared = {module_of.get(d, d) for d in core | extras} | doc_build | with_an_extra
    assert imported <= declared, f"imported but not declared: {sorted(imported - declared)}"
    assert {module_of.get(d, d) for d in core} <= imported, f"declared but never imported: {sorted({module_of.get(d, d) for d in core} - imported)}"
    assert "sympy" not in core and "sympy" not in imported  # the notebooks' and tests' algebra, not the package's


def test_the_torch_floor_has_what_the_package_uses():
    "torch>=2.9: torch.optim.Muon (2.9) and torch.compiler.is_compiling (2.3) are used; the floor must not claim less."
    import torch
    floor = next(r for r in shlex.split(_settings()["requirements"]) if r.startswith("torch"))
    assert floor == "torch>=2.9"
    assert hasattr(torch.optim, "Muon") and hasattr(torch.compiler, "is_compiling")
    used = " ".join(p.read_text() for p in (ROOT / "basedirected").glob("*.py"))
    assert "torch.optim.Muon" in used and "torch.compiler.is_compiling" in used  # the reason for the floor is still there


def _reference_minutes(preset):
    from basedirected.repro import reference_minutes
    return reference_minutes(preset)


def _readme_and_answer_in_full() -> str:
    "The README and the guide's longer answer, whitespace collapsed: the README's answer is short, its detail (and the figures it quotes) is in the guide."
    import json
    guide = [ "".join(c["source"]) for c in json.loads((ROOT / "nbs" / "15_guide.ipynb").read_text())["cells"]]
    (full,) = [c for c in guide if c.startswith("## The answer in full")]
    return " ".join(((ROOT / "README.md").read_text() + "\n" + full).split())


def test_the_readmes_answer_is_short_and_every_figure_in_it_is_the_files():
    "The README's answer: at most 250 words (its heading and figure aside), every number read from the reference files, the main job's headline its reference run's."
    import json
    from basedirected.collection import read_records
    from basedirected.reports import base_contrasts, headline_text
    readme = (ROOT / "README.md").read_text()
    answer = readme[readme.index("## The answer\n"):readme.index("## The main job\n")]
    prose = [l for l in answer.splitlines()[1:] if not l.startswith("![")]
    assert len(" ".join(prose).split()) <= 250, len(" ".join(prose).split())
    text = " ".join(answer.split())
    fmt = lambda v: f"{float(v):+.3f}".replace("-", "−")
    shown = lambda r: f"{fmt(r['mean'])} [{fmt(r['lo'])}, {fmt(r['hi'])}]"
    entropy = {(r["cell"], r["comparison"]): r for r in base_contrasts(read_records(ROOT / "reference" / "entropy"), ("gen_alignment_controlled_all_excess",))}
    assert f"`dist` does not: {shown(entropy[('beta 0.05', 'dist - celbo')])} (`reference/entropy/`)" in text
    assert entropy[("beta 0.05 forms 4", "dist - celbo")]["lo"] < 0 < entropy[("beta 0.05 forms 4", "dist - celbo")]["hi"]
    settled = {(r["regime"], r["cell"], r["comparison"]): r for r in base_contrasts(read_records(ROOT / "reference" / "settled"), ("gen_alignment_controlled_all_excess",))}
    assert f"$\\mathcal J_\\theta$ − `dist` {shown(settled[('sorting', 'tau 0.07', 'theta - dist')])} on sorting" in text
    assert all(settled[(t, "tau 0.07", c)]["lo"] < 0 < settled[(t, "tau 0.07", c)]["hi"] for t in ("sorting", "grid_pathfinding")
               for c in ("theta - dist", "theta - celbo", "dist - celbo"))  # the three are not resolved apart at equal tau
    dose = [r for r in read_records(ROOT / "reference" / "settled") if r["regime"] == "sorting" and r["objective"] == "theta" and r.get("alpha") == 0.0]
    assert (round(100 * min(r["gen_answer_rate"] for r in dose), 1), round(100 * max(r["gen_answer_rate"] for r in dose), 1)) == (0.0, 2.7) and "answers right on 0–2.7 %" in text
    forms4 = [r["c_model"] for r in read_records(ROOT / "reference" / "entropy") if int(r.get("surface_forms") or 1) == 4]
    assert f"{sum(forms4) / len(forms4):.2f}" == "1.33" and "(1.33 nats per token)" in text
    from basedirected.repro import repro_parser
    main = ROOT / "reference" / "rescaling-one-seed"  # the main job's reference run: the default preset's
    assert f"`{main.name}` (default)" in readme and f"(default: {main.name})" in repro_parser().format_help().replace("\n", " ").replace("  ", " ")
    headline = headline_text(read_records(main))
    assert headline.count("Headline:") == 1 and "resolved." in headline and f"> {headline}" in readme
    summary = json.loads((main / "summary.json").read_text())
    assert summary["missing"] == [] and f"({summary['runs']} runs in {_reference_minutes(main.name):.1f} minutes on a 2-core CPU" in " ".join(readme.split())
    assert f"![The main job's answer: each run's controlled alignment, and each pair's difference with its interval](reference/{main.name}/figures/answer.png)" in answer


def test_the_readme_is_a_newcomers_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1800, f"README.md has {len(text.split())} words"
    for heading in ("## Install and run", "## The answer", "## One run", "## Your own task", "## A Hugging Face model", "## A GPU", "## A cluster"):
        assert heading in text
    import re
    results = [l for l in re.findall(r"\]\((nbs/[^)#]+)", text) if l.startswith("nbs/13")]
    assert results[0] == "nbs/13_findings.ipynb", results  # the findings page is the first result a newcomer is sent to


def test_the_readmes_figures_are_the_reference_files():
    "Each time and interval the README quotes is read from the file it comes from."
    import json
    text = _readme_and_answer_in_full()
    for preset, shown in (("rescaling-one-seed", "3.4 min"), ("rescaling", "7.4 min"), ("quick", "3.2 min"), ("study", "53.5 min"), ("followup", "88.8 min, three invocations"), ("addition", "93.4 min"),
                          ("settled", "261.2 min, three invocations: 94 of 112 cells"), ("settled-2", "100.3 min")):
        assert f"{_reference_minutes(preset):.1f} min" in shown and shown in text, (preset, _reference_minutes(preset))
    settled = json.loads((ROOT / "reference" / "settled" / "summary.json").read_text())
    assert f"{settled['runs']} of {settled['runs'] + len(settled['missing'])} cells" in text
    from basedirected.cluster import read_records
    from basedirected.reports import base_contrasts
    def contrast(regime, comparison, collection="settled"):
        "A settled contrast in alignment excess by the one interval rule (`contrast_interval`, unsettled pairs left out), as the README writes it: mean [lo, hi]."
        (r,) = [r for r in base_contrasts(read_records(ROOT / "reference" / collection), ("gen_alignment_controlled_all_excess",))
                if (r["regime"], r["cell"], r["comparison"]) == (regime, "tau 0.07", comparison)]
        fmt = lambda v: f"{float(v):+.3f}".replace("-", "−")
        return f"{fmt(r['mean'])} [{fmt(r['lo'])}, {fmt(r['hi'])}]"
    for regime, comparison in (("sorting", "theta - dist"), ("grid_pathfinding", "theta - dist"), ("sorting", "theta - celbo"), ("grid_pathfinding", "theta - celbo")):
        assert contrast(regime, comparison) in text, (regime, comparison, contrast(regime, comparison))
    for comparison in ("theta - dist", "theta - celbo"):  # addition's arm, run whole on bases trained again
        assert contrast("addition", comparison, "settled-2") in text, (comparison, contrast("addition", comparison, "settled-2"))
    from basedirected.reports import curve_verdicts, success_parts
    parts = {p["objective"]: p for p in success_parts(read_records(ROOT / "reference" / "settled")) if p["regime"] == "sorting" and p["cell"] == "tau 0.07"}
    named = {o: (parts[o]["meaning_met"], parts[o]["runs"], parts[o]["unsettled"]) for o in ("theta", "dist", "celbo")}
    assert named == {"theta": (12, 12, 0), "dist": (12, 12, 0), "celbo": (10, 10, 2)}, named  # the one unsettled policy: left out, and counted
    assert "every objective's codes name the strategy on every settled sorting run (12 of $\\mathcal J_\\theta$, 12 of `dist`, 10 of the cELBO, whose 2 unsettled runs are left out)" in text
    verdicts = curve_verdicts(ROOT / "reference" / "settled")
    assert (sum(bool(v["settled_strict"]) for v in verdicts.values()), len(verdicts)) == (28, 94) and "passes 28 of settled's 94 runs" in text
    from basedirected.reports import strict_rule_in_nats
    in_nats = strict_rule_in_nats(ROOT / "reference" / "settled")
    assert sum(bool(v["settled_strict_nats"]) for v in in_nats.values()) == sum(bool(v["settled"]) for v in verdicts.values()) == 87 and "in nats per token it passes all 87 the rate rule passes" in text
    assert round(max(v["recon_fall_nats"] for v in in_nats.values() if v["settled"]), 3) == 0.002 and "the largest fall 0.002 nats" in text


def test_the_readmes_meaning_paragraph_is_the_reference_files():
    "The meaning paragraph's counts, recomputed from the reference collections by the findings page's definitions and the one unsettled policy (settled_runs)."
    import csv
    import json
    from scipy.stats import fisher_exact
    text = _readme_and_answer_in_full()
    for preset, shown in (("meaning", "311.7 min, five invocations in three sittings"), ("reader", "24.4 min"), ("shortcut", "46.5 min"), ("baseline", "46.4 min")):
        assert f"{_reference_minutes(preset):.1f} min" in shown and shown in text, (preset, _reference_minutes(preset))
    summary = json.loads((ROOT / "reference" / "meaning" / "summary.json").read_text())
    assert (summary["runs"], summary["missing"]) == (100, [])
    read = lambda name: [{k: (float(v) if v.replace(".", "").replace("-", "").replace("e", "").isdigit() else v) for k, v in r.items()}
                         for r in csv.DictReader(open(ROOT / "reference" / name / "results.csv"))]
    from basedirected.cluster import read_records
    from basedirected.comparisons import settled_runs
    from basedirected.reports import success_parts
    from basedirected.comparisons import names_strategy as names  # the one definition every page counts by
    plain = lambda r, regime: (r["regime"] == regime and r["objective"] == "theta" and r.get("alpha", 0.5) == 0.5 and not r.get("coupling") and r.get("K", 3) == 3
                               and r.get("router", "input") == "input" and r.get("code_init_noise", 0.02) == 0.02 and (r.get("lr") or 1e-3) == 1e-3)
    def named(collection, regime):  # J_theta without a breaker, settled runs, base by base (the findings page's count)
        by = {}
        for r in settled_runs([r for r in read_records(ROOT / "reference" / collection) if plain(r, regime)])[0]: by.setdefault(r["base_seed"], []).append(names(r))
        return [f"{sum(v)} of {len(v)}" for _, v in sorted(by.items())]
    assert named("settled", "sorting") == ["4 of 4"] * 3 and "names the strategy on 4 of 4 settled runs on each of sorting's three bases" in text
    assert named("settled", "grid_pathfinding") == ["0 of 4", "1 of 3", "3 of 4"] and named("reader", "grid_pathfinding") == ["7 of 9"]
    assert "on grid pathfinding on 0 of 4, 1 of 3 and 3 of 4 on settled's bases and 7 of 9 on `meaning`'s" in text
    assert (named("settled", "addition"), named("settled-2", "addition"), named("baseline", "addition")) == (["2 of 4", "3 of 4"], ["3 of 4", "0 of 3"], ["0 of 5"])
    assert "on addition on 2 of 4 and 3 of 4 (settled), 3 of 4 and 0 of 3 (`settled-2`) and 0 of 5 (`meaning`'s base, `reference/baseline/`)" in text
    coupled, cu = settled_runs([r for r in read_records(ROOT / "reference" / "meaning") if r["regime"] == "grid_pathfinding" and r.get("coupling") == 1.0 and r["objective"] == "theta"])
    control, tu = settled_runs([r for r in read_records(ROOT / "reference" / "reader") if not r.get("coupling")])
    input_code = lambda r: r["router_entropy"] < 0.35 and r["I_zs_given_x_norm"] < 0.2
    assert (len(coupled), cu, sum(map(input_code, coupled)), sum(map(names, coupled)), len(control), sum(map(names, control))) == (9, 1, 6, 3, 9, 7)
    p = fisher_exact([[3, 6], [7, 2]]).pvalue
    assert f"Fisher exact p {p:.2f}" in text and "6 of 9 settled $\\mathcal J_\\theta$ runs took that route at ρ = 1 (named 3 of 9, against 7 of 9 without the term" in text
    shortcut = read("shortcut")
    took = lambda r: r["eval_coupling"] < -0.3 and r["I_zs_given_x_norm"] < 0.2
    assert (len(shortcut), sum(map(took, shortcut)), settled_runs(read_records(ROOT / "reference" / "shortcut"))[1]) == (20, 0, 0) and "no run took it (0 of 20" in text
    assert sum(map(names, (r for r in shortcut if r["objective"] == "theta"))) == 8 and "named the strategy on 8 of 10 runs" in text
    term = {name: settled_runs([r for r in read_records(ROOT / "reference" / name) if r["regime"] == "addition"])[0] for name in ("shortcut-addition", "shortcut-addition-2")}
    without = {"meaning": settled_runs([r for r in read_records(ROOT / "reference" / "baseline")])[0],
               "settled-2": settled_runs([r for r in read_records(ROOT / "reference" / "settled-2") if r["regime"] == "addition" and r["objective"] == "theta"])[0]}
    succeeds = lambda r: r["gen_alignment_controlled_all"] >= 0.9 and r["gen_answer_rate"] >= 0.98
    count = lambda rs, base: f"{sum(succeeds(r) for r in rs if r['base_seed'] == base)} of {sum(r['base_seed'] == base for r in rs)}"
    assert [count(term["shortcut-addition"], 0), count(term["shortcut-addition"], 1), count(term["shortcut-addition-2"], 0)] == ["3 of 5", "1 of 5", "3 of 5"]
    assert [count(without["meaning"], 0), count(without["settled-2"], 1), count(without["settled-2"], 0)] == ["0 of 5", "0 of 3", "3 of 4"]
    assert "succeeds on 3 of 5 runs of `meaning`'s base and 1 of 5 and 3 of 5 on `settled-2`'s, against 0 of 5, 0 of 3 and 3 of 4 without it" in text
    parts = {(p["regime"], p["objective"]): p for p in success_parts(read_records(ROOT / "reference" / "settled")) if p["cell"] == "tau 0.07"}
    assert sum(parts[("sorting", o)]["success_undecided"] for o in ("theta", "dist", "celbo")) == 33 and sum(parts[("sorting", o)]["runs"] for o in ("theta", "dist", "celbo")) == 34
    assert all(parts[("sorting", o)]["meaning_met"] == parts[("sorting", o)]["runs"] for o in ("theta", "dist", "celbo")) and "undecided on 33 of 34 runs" in text
    costs = [parts[("grid_pathfinding", o)]["validity_cost"] for o in ("theta", "dist", "celbo")]
    assert (round(-max(costs) * 100, 1), round(-min(costs) * 100, 1)) == (2.5, 3.5) and "adaptation costs 2.5–3.5 points of validity under every objective" in text


def test_the_readmes_language_model_paragraph_is_the_reference_files():
    "The regime of a language model: each level's measured c_theta and each contrast the README quotes, by the one interval rule from reference/entropy."
    import json
    from basedirected.cluster import read_records
    from basedirected.comparisons import settled_runs
    from basedirected.reports import base_contrasts
    text = _readme_and_answer_in_full()
    assert f"{_reference_minutes('entropy'):.1f} min" == "180.7 min" and "| 180.7 min, five invocations |" in text
    summary = json.loads((ROOT / "reference" / "entropy" / "summary.json").read_text())
    assert (summary["runs"], summary["missing"]) == (276, [])
    records = read_records(ROOT / "reference" / "entropy")
    level = lambda r: int(r.get("surface_forms") or 1)
    per_base = {m: {r["base_seed"]: r["c_model"] for r in records if level(r) == m} for m in (1, 2, 4)}
    c_hat = {m: round(sum(v.values()) / len(v), 2) for m, v in per_base.items()}  # each level's mean over its bases
    assert c_hat == {1: 0.04, 2: 0.68, 4: 1.33} and "from 0.04 to 0.68 and 1.33 nats per token" in text
    assert {(level(r), r["base_seed"]) for r in records} == {(m, b) for m in (1, 2, 4) for b in (0, 1, 2)} and {r["seed"] for r in records} == {0, 1, 2, 3}
    fmt = lambda v: f"{float(v):+.3f}".replace("-", "−")
    rows = {(r["cell"], r["comparison"]): f"{fmt(r['mean'])} [{fmt(r['lo'])}, {fmt(r['hi'])}]" for r in base_contrasts(records, ("gen_alignment_controlled_all_excess",))}
    assert f"`dist` − cELBO is {rows[('beta 0.05', 'dist - celbo')]} at 0.04 and {rows[('beta 0.05 forms 4', 'dist - celbo')]} at 1.33, both collapsed" in text
    assert all(r["rate"] < 1e-3 for r in records if level(r) == 4 and r.get("beta_target") is not None)
    assert f"$\\mathcal J_\\theta$ − `dist` at 1.33: {rows[('tau 0.07 forms 4', 'theta - dist')]}" in text
    top = {k: r for k, r in ((r["comparison"], r) for r in base_contrasts(records, ("gen_alignment_controlled_all_excess",)) if r["cell"] == "tau 0.07 forms 4")}
    assert all(top[f"theta - {a}"]["lo"] < 0 < top[f"theta - {a}"]["hi"] for a in ("dist", "celbo", "celbo_free_bits", "celbo_cyclical"))
    from basedirected.comparisons import code_verdict
    relabelled = {r["objective"] for r in settled_runs([r for r in records if level(r) == 4 and r.get("tau_target") is not None])[0]
                  if code_verdict(r) in ("relabels", "between")}  # the one definition (notebook 08a)
    assert relabelled == {"theta", "dist", "celbo", "celbo_free_bits"} and "codes relabel across inputs under each objective but the cyclical schedule" in text

def test_the_readmes_default_run_is_the_reference_run():
    "The default command's figures in the README are its reference run's metrics.json, its times the run's log (idle, then beside another job)."
    import json
    import re
    ref = ROOT / "reference" / "default-run"
    m = json.loads((ref / "metrics.json").read_text())
    assert (ref / "command.txt").read_text().split()[:3] == ["basedirected-train", "--run-dir", "/tmp/default-run"]
    from basedirected.runs import recorded_shipped_base  # the reference run's record predates `shipped_base`: read through its reader
    assert recorded_shipped_base(json.loads((ref / "config.json").read_text())) == "sorting-s0" and m["base_name"] == "sorting-s0"
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "basedirected-train --run-dir runs/x ```" in text
    assert m["settled"] is True and m["rate"] > 0.55 and m["gen_alignment_controlled_all"] - m["gen_alignment_controlled_all_null"] > 0.2
    from basedirected.comparisons import code_verdict
    assert code_verdict({"K": 3, **m}) == "names"  # the one definition of the word
    assert (f"a held-out rate of {m['rate']:.3f} nats (log 3 = {math.log(3):.3f}) with forced generations that follow their code's strategy in "
            f"{100 * m['gen_alignment_controlled_all']:.1f} % (chance {100 * m['gen_alignment_controlled_all_null']:.1f} %) and codes that name the strategy, "
            f"answers right on {100 * m['gen_answer_rate']:.1f} %, settled") in text
    idle, loaded = (int(mi) * 60 + float(s) for mi, s in re.findall(r"^real\s+(\d+)m([\d.]+)s", (ref / "run.log").read_text(), re.M))
    assert idle <= 90 and f"{idle:.1f} s on 2 idle cores, {loaded:.1f} s beside one other 2-thread job" in text


def test_the_readmes_gpu_estimate_is_the_packages():
    from basedirected.experiments import pack_memory_gib
    from basedirected.presets import PRESETS, plan
    from basedirected.groups import pack_groups
    specs = plan(PRESETS["paper"])
    needs = [pack_memory_gib([specs[i].config for i in p]) for p in pack_groups([s.config for s in specs], 64)]
    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"the paper preset's {len(needs)} groups {min(needs):.1f}–{max(needs):.1f} GiB each" in text


def test_the_repro_help_states_each_presets_reference_time():
    from basedirected.repro import preset_help
    for preset in ("quick", "study", "followup", "addition"):
        assert f"reference run {_reference_minutes(preset):.1f} min" in preset_help(preset)


def test_the_guide_names_every_preset_and_no_withdrawn_claim():
    "The guide's presets table covers every preset; the claims the README withdrew are not stated there as findings."
    import json
    from basedirected.presets import PRESETS
    guide = " ".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "15_guide.ipynb").read_text())["cells"])
    table = guide[guide.index("| option | meaning |"):guide.index("## ", guide.index("| option | meaning |"))]
    assert not [name for name in PRESETS if name != "smoke" and f"`{name}`" not in table and f"--preset {name}`" not in table]
    assert "its lead over the cELBO is gradient clipping" not in guide and "to log 2 by step 50" not in guide


def test_no_page_cites_a_design_note():
    "Readers have the pages, not the design notes behind them: a page says what a note says in its own words."
    import re
    cited = [f"{p.name}: ...{m.group(0)}..." for p in sorted((ROOT / "nbs").glob("*.ipynb")) for m in re.finditer(r".{30}\bnotes? 00\d.{20}", p.read_text())]
    cited += [f"README.md: ...{m.group(0)}..." for m in re.finditer(r".{30}\bnotes? 00\d.{20}", (ROOT / "README.md").read_text())]
    assert not cited, "\n".join(cited)


def test_the_main_jobs_reference_run_says_what_its_files_hold():
    "reference/rescaling/README.md: each prediction's outcome and the cell-by-cell agreement with the entropy collection, from the files."
    from basedirected.collection import read_records
    from basedirected.reports import base_contrasts, success_counts
    text = " ".join((ROOT / "reference" / "rescaling" / "README.md").read_text().split())
    metric = "gen_alignment_controlled_all_excess"
    new, entropy = read_records(ROOT / "reference" / "rescaling"), {r["key"]: r for r in read_records(ROOT / "reference" / "entropy")}
    assert len(new) == 12 and all(r["settled"] for r in new) and f"12 runs in {_reference_minutes('rescaling'):.1f} minutes" in text
    (c,) = base_contrasts(new, (metric,))
    fmt = lambda v: f"{v:+.3f}".replace("-", "−")
    assert 0.456 < c["mean"] < 0.657 and c["lo"] > 0 and f"{fmt(c['mean'])} [{fmt(c['lo'])}, {fmt(c['hi'])}] over the 3 bases (6 pairs" in text
    span = lambda o: (min(r[metric] for r in new if r["objective"] == o), max(r[metric] for r in new if r["objective"] == o))
    (clo, chi), (dlo, dhi) = span("celbo"), span("dist")
    assert max(abs(clo), abs(chi)) < 0.05 and dlo > 0.25 and f"cELBO {fmt(clo)} to {fmt(chi)}; `dist` {fmt(dlo)} to {fmt(dhi)}: held" in text
    def base_mean(records, base, seeds):
        d = {r["seed"]: r[metric] for r in records if r["base_seed"] == base and r["objective"] == "dist" and r["seed"] in seeds}
        c = {r["seed"]: r[metric] for r in records if r["base_seed"] == base and r["objective"] == "celbo" and r["seed"] in seeds}
        return sum(d[s] - c[s] for s in d) / len(d)
    ent = [r for r in entropy.values() if r.get("beta_target") == 0.05 and int(r.get("surface_forms") or 1) == 1]
    gaps = [abs(base_mean(new, b, (0, 1)) - base_mean(ent, b, (0, 1, 2, 3))) for b in (0, 1, 2)]
    assert max(gaps[:2]) <= 0.012 and round(gaps[2], 3) == 0.073 and "base 2 +0.584 against +0.512, off by 0.073: missed" in text
    assert round(abs(base_mean(new, 2, (0, 1)) - base_mean(ent, 2, (0, 1))), 3) == 0.009 and "(+0.575) it is off by 0.009" in text
    exact = [r["key"] for r in new if r[metric] == entropy[r["key"]][metric]]
    assert len(exact) == 3 and all("-dist-" in k and k.endswith("-s1") for k in exact) and "3 of the 12 cells equal it exactly" in text
    assert round(max(abs(r[metric] - entropy[r["key"]][metric]) for r in new), 3) == 0.011 and "differ by at most 0.011" in text
    wins = {s["objective"]: round(s["success"] * s["success_n"]) for s in success_counts(new)}
    assert wins == {"dist": 6, "celbo": 0} and "`dist` names the strategy on 6 of 6 runs" in text and "the cELBO on 0 of 6" in text


def test_a_name_that_moved_room_still_imports_from_its_old_one_with_a_warning():
    "Users' code imports a moved name from where it was for one more release: it gets the same object and a DeprecationWarning naming the new module."
    import importlib
    import warnings
    for old, new, names in (("basedirected.experiments", "basedirected.presets", "MOVED_TO_PRESETS"), ("basedirected.hf", "basedirected.backbone", "MOVED_TO_BACKBONE")):
        if old.endswith("hf"): pytest.importorskip("transformers")
        module = importlib.import_module(old)
        for name in getattr(module, names):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert getattr(module, name) is getattr(importlib.import_module(new), name)
            assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [f"{old}.{name} moved to {new}.{name}; import it from there"]
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"): getattr(module, "nonsense")
    from basedirected.experiments import Preset, RunSpec, plan  # still used by the runner: plain names, no warning
    from basedirected import presets
    assert (Preset, RunSpec, plan) == (presets.Preset, presets.RunSpec, presets.plan)


def test_every_rank_test_and_barrier_outside_the_steppers_is_one_the_guide_names():
    "Rank tests and barriers live in the steppers, except where the guide says why (before a stepper exists, or after): a new one fails here until it is named."
    import ast
    import json
    import collections
    found = collections.Counter()
    for path in sorted((ROOT / "basedirected").glob("*.py")):
        if path.name == "_modidx.py": continue
        def walk(node, where):
            for child in ast.iter_child_nodes(node):
                inner = [*where, child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else where
                if isinstance(child, ast.Call) and getattr(child.func, "id", getattr(child.func, "attr", None)) == "barrier": found[(path.stem, ".".join(where))] += 1
                if (isinstance(child, ast.Compare) and len(child.ops) == 1 and isinstance(child.ops[0], (ast.Eq, ast.NotEq)) and isinstance(child.comparators[0], ast.Constant)
                        and child.comparators[0].value == 0 and getattr(child.left, "id", getattr(child.left, "attr", None)) == "rank"): found[(path.stem, ".".join(where))] += 1
                walk(child, inner)
        walk(ast.parse(path.read_text()), [])
    steppers = {("train", "ShardedRun.__init__"), ("train", "ShardedRun.finish"), ("machine", "barrier")}
    named = {("cli", "train_main"), ("train", "run"), ("hf", "hf_run"), ("runs", "prepare_run"), ("hf", "prepare_hf_run"), ("hf", "_hf_run"), ("train", "_stages")}
    assert set(found) - steppers == named, sorted(set(found) - steppers - named)
    guide = " ".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "15_guide.ipynb").read_text())["cells"])
    section = guide[guide.index("**Processes outside the stepper.**"):]
    assert all(f"`{function}`" in section[:1500] for _, function in named)


def test_the_main_jobs_reference_run_of_one_seed_says_what_its_files_hold():
    "reference/rescaling-one-seed/README.md: each prediction's outcome, from the files; its cells are the rescaling collection's seed-0 cells, equal bit for bit."
    import json
    from basedirected.collection import read_records
    from basedirected.reports import base_contrasts, success_counts
    ref = ROOT / "reference" / "rescaling-one-seed"
    text = " ".join((ref / "README.md").read_text().split())
    metric = "gen_alignment_controlled_all_excess"
    new, twelve = read_records(ref), {r["key"]: r for r in read_records(ROOT / "reference" / "rescaling")}
    assert len(new) == 6 and all(r["settled"] for r in new) and f"6 runs in {_reference_minutes(ref.name):.1f} minutes" in text
    assert "AMD EPYC" in json.loads((ref / "summary.json").read_text())["cpus"][0] and "AMD EPYC" in json.loads((ROOT / "reference" / "rescaling" / "summary.json").read_text())["cpus"][0]
    numbers = lambda r: {k: v for k, v in r.items() if isinstance(v, float) and k != "seconds"}
    assert all(numbers(r) == numbers(twelve[r["key"]]) for r in new) and "every metric of all 6 cells equal to the rescaling collection's" in text
    (c,) = base_contrasts(new, (metric,))
    fmt = lambda v: f"{v:+.3f}".replace("-", "−")
    assert c["lo"] > 0 and f"{fmt(c['mean'])} [{fmt(c['lo'])}, {fmt(c['hi'])}] over the 3 bases (3 pairs" in text and "+0.566 [+0.490, +0.642]" in text
    assert not 3.5 <= _reference_minutes(ref.name) <= 4.5 and "missed, faster than predicted" in text
    wins = {s["objective"]: round(s["success"] * s["success_n"]) for s in success_counts(new)}
    assert wins == {"dist": 3, "celbo": 0} and "`dist` names the strategy on 3 of 3 runs" in text and "the cELBO on 0 of 3" in text
