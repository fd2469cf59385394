"""Code labellings per input group: which code the posterior gives each strategy, group by group of held-out inputs.

A run can name every input's strategy with codes that mean different strategies on different inputs (a per-input
relabelling, notebook 07a). This script rebuilds each finished run from its directory (`load_run`: the base, the
held-out split, the trained CVAE), computes its posterior q(z|x,y) on the held-out pairs at the last step's KL weight,
and counts, per group of inputs, how often each strategy's pairs get each code (the posterior's most likely code).
Groups are a feature of the input a response can show: the operands' digit counts on addition, the input's length
elsewhere. It checks its posterior against the run's own record (the posterior table's alignment in metrics.json)
and writes one CSV row per run, group, strategy and code:

    python benchmarks/code_labellings.py runs/meaning/runs/addition-* --out reference/meaning/labellings.csv

Figures are printed and written, never asserted.
"""
import argparse
import csv
import json
from collections import Counter
from pathlib import Path

import torch

import basedirected.addition, basedirected.grid_pathfinding, basedirected.sorting  # registers the tasks
from basedirected.addition import operands
from basedirected.cvae import posterior_forward
from basedirected.metrics import posterior_meaning
from basedirected.runs import load_run


def input_group(task_name: str, x) -> str:
    "The feature of the input the groups follow: the operands' digit counts on addition ('3+4'), the input's length elsewhere."
    if task_name == "addition": return "+".join(str(len(str(v))) for v in operands(x))
    return f"length {len(x)}"


@torch.no_grad()
def held_out_posterior(run_dir: Path) -> tuple[list, torch.Tensor, dict]:
    "The run's held-out examples, its posterior on them at the last step's KL weight, and its metrics.json."
    run = load_run(run_dir)
    model, rows, cache = run.model, run.eval_rows, run.eval_cache
    model.eval()
    beta, qs = run.kl_weight(run.config.train.steps - 1), []
    for i in range(0, len(rows), 128):
        idx = torch.arange(i, min(i + 128, len(rows)))
        b, mask = cache.lookup(idx)
        out = posterior_forward(model, rows.select(idx), b, mask, run.c_ref, run.config.loss, beta, torch.Generator().manual_seed(run.config.seed + i))
        qs.append(out.q.float().cpu())
    return run.held_out, torch.cat(qs), json.loads((run_dir / "metrics.json").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run directories (each with metrics.json and checkpoint.pt)")
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out_rows = []
    for run_dir in sorted(args.runs):
        if not (run_dir / "metrics.json").exists(): print(f"{run_dir.name}: not finished, skipped"); continue
        held, q, metrics = held_out_posterior(run_dir)
        strategies = torch.tensor([e.strategy for e in held])
        again = posterior_meaning(q, strategies, int(strategies.max()) + 1)["alignment_posterior"]
        print(f"{metrics['key']}: posterior alignment {again:.4f} (its record: {metrics['alignment_posterior']:.4f})")
        counts = Counter((input_group(metrics["task"], e.x), e.strategy, k) for e, k in zip(held, q.argmax(-1).tolist()))
        for (group, s, k), n in sorted(counts.items()):
            out_rows.append({"key": metrics["key"], "group": group, "strategy": s, "code": k, "n": n,
                             "alignment_posterior_recomputed": round(again, 6), "alignment_posterior_recorded": round(metrics["alignment_posterior"], 6)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out_rows[0])); w.writeheader(); w.writerows(out_rows)
    print(f"{len(out_rows)} rows written to {args.out}")


if __name__ == "__main__":
    main()
