"""Escape curves: how many CVAE steps the latent needs to leave its inert start, per task, objective, tau and posterior.

Every cell is a `basedirected-train` command run to `--steps` with a held-out evaluation every `--every` steps; the base
(and c_theta, and the gate) is trained once into `OUT/base` with the task's recipe and copied into each cell's directory,
so all cells adapt the same base. Cells run `--jobs` at a time, one torch thread each. For each cell it prints the held-out
rate KL(q || r) at every evaluation, the first step at which the rate reaches half of log K (the escape step, or 'none'),
and the rate at the end; `OUT/curves.json` holds the same. This is the instrument behind the presets' run lengths.

    python benchmarks/escape_curves.py --task sorting --taus 0.07,0.2 --steps 1000 --out runs/escape-sorting
    python benchmarks/escape_curves.py --task sorting --taus 0.07 --posterior amortized --steps 1500 --out runs/escape-sorting
    python benchmarks/escape_curves.py --task sorting --taus 0.07 --grad-clips 1,1e6 --out runs/escape-clip   # 1e6: no clipping

Figures are printed and written, never asserted.
"""
import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE_FILES = ("base.pt", "reference_scale.json", "base_gate.json")
METRICS = ("rate", "gen_alignment_controlled_all", "gen_alignment_controlled_all_null", "gen_alignment_controlled_all_excess", "I_zs_norm",
           "I_zs_given_x_norm", "gen_answer_rate", "gain_z", "drift", "beta_effective")  # what --metrics collects from each cell


def escape_step(curve: list[tuple[int, float]], K: int) -> int | None:
    "The first evaluated step whose held-out rate is at least half of log K (None: the latent never left)."
    return next((step for step, rate in curve if rate >= 0.5 * math.log(K)), None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="a task name (visiting_order regimes via --regime)")
    p.add_argument("--regime", default=None, help="the task's preset")
    p.add_argument("--objectives", default="theta,dist,celbo", help="comma-separated objective names; theta:ALPHA:GAMMA gives J_theta other "
                   "token weights (theta alone is the default alpha 0.5, gamma 1)")
    p.add_argument("--taus", default="0.07,0.2", help="comma-separated tau (KL weight as a share of each objective's break-even)")
    p.add_argument("--posterior", default="exact", choices=("exact", "amortized", "exact+distill"))
    p.add_argument("--grad-clips", default="1", help="comma-separated gradient-norm clipping thresholds (1e6: no clipping in effect)")
    p.add_argument("--seeds", default="0", help="comma-separated CVAE seeds (every cell adapts the --base-seed base)")
    p.add_argument("--base-seed", type=int, default=0)
    p.add_argument("--K", type=int, default=3)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="held-out evaluation period")
    p.add_argument("--jobs", type=int, default=2, help="cells at a time, one torch thread each")
    p.add_argument("--metrics", action="store_true", help="every cell also writes metrics.json (alignment, I(z;s), answers...), "
                   "collected with the curves into OUT/cells.csv")
    p.add_argument("--out", required=True, help="directory: OUT/base, one directory per cell, OUT/curves.json")
    a = p.parse_args(argv)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    where = ["--task", a.task] + (["--regime", a.regime] if a.regime else [])
    common = [*where, "--base-seed", str(a.base_seed), "--K", str(a.K), "--threads", "1", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = out / "base"
    if not all((base / f).exists() for f in BASE_FILES):  # one step of a CVAE trains the base, c_theta and (with metrics) the gate
        t0 = time.time()
        r = subprocess.run(["basedirected-train", "--run-dir", str(base), *common, "--steps", "1", "--allow-failed-base", "--force"],
                           capture_output=True, text=True, env=env)
        if r.returncode: sys.exit(r.stderr[-2000:])
        print(f"base trained in {time.time() - t0:.0f} s", flush=True)
    gate = json.loads((base / "base_gate.json").read_text())
    print(f"base gate: {'passes' if gate['passes'] else 'FAILS: ' + '; '.join(gate['failures'])}", flush=True)

    def cell(c):
        obj, tau, clip, seed = c
        name, *weights = obj.split(":")  # theta:ALPHA:GAMMA
        weight_argv = ["--alpha", weights[0], "--gamma", weights[1]] if weights else []
        d = out / (f"{a.posterior}-{obj.replace(':', '_')}-t{tau}-s{seed}" + (f"-clip{clip:g}" if clip != 1 else ""))
        d.mkdir(exist_ok=True)
        for f in BASE_FILES:
            if not (d / f).exists(): shutil.copy(base / f, d / f)
        t0 = time.time()
        r = subprocess.run(["basedirected-train", "--run-dir", str(d), *common, "--objective", name, *weight_argv, "--tau", str(tau), "--seed", str(seed),
                            "--grad-clip", str(clip), "--posterior", a.posterior, "--steps", str(a.steps), "--eval-every", str(a.every), "--checkpoint-every", str(a.steps),
                            *([] if a.metrics else ["--no-metrics"]), "--allow-failed-base"], capture_output=True, text=True, env=env)
        if r.returncode: return c, None, r.stderr[-2000:]
        ev = [json.loads(l) for l in (d / "log.jsonl").read_text().splitlines() if '"split": "eval"' in l]
        m = json.loads((d / "metrics.json").read_text()) if a.metrics else {}
        return c, {"curve": [(e["step"], e["kl"]) for e in ev], "seconds": time.time() - t0, "metrics": {k: m.get(k) for k in METRICS if k in m},
                   "command": (d / "command.txt").read_text().strip() if (d / "command.txt").exists() else None}, None

    cells = list(itertools.product(a.objectives.split(","), [float(t) for t in a.taus.split(",")], [float(g) for g in a.grad_clips.split(",")],
                                   [int(s) for s in a.seeds.split(",")]))
    results = []
    with ThreadPoolExecutor(a.jobs) as pool:
        for (obj, tau, clip, seed), res, err in pool.map(cell, cells):
            if err: print(f"{obj} tau {tau} clip {clip:g} seed {seed}: failed\n{err}", flush=True); continue
            step = escape_step(res["curve"], a.K)
            print(f"{a.task} {a.posterior} {obj} tau {tau} clip {clip:g} seed {seed}: escape step {step if step is not None else 'none'}, "
                  f"final rate {res['curve'][-1][1]:.3f} nats ({res['seconds']:.0f} s)  "
                  + " ".join(f"{s}:{k:.3f}" for s, k in res["curve"]), flush=True)
            results.append({"objective": obj, "tau": tau, "grad_clip": clip, "seed": seed, "escape_step": step, **res})
    if a.metrics:  # one row per cell: its coordinates, escape step, final rate and metrics
        with open(out / "cells.csv", "w") as f:
            cols = ["objective", "tau", "grad_clip", "seed", "escape_step", *METRICS, "command"]
            f.write(",".join(cols) + "\n")
            for r in results:
                row = {**{k: r[k] for k in ("objective", "tau", "grad_clip", "seed", "escape_step")}, **r["metrics"], "rate": r["curve"][-1][1], "command": json.dumps(r["command"])}
                f.write(",".join("" if row.get(k) is None else str(row[k]) for k in cols) + "\n")
    (out / "curves.json").write_text(json.dumps({"task": a.task, "regime": a.regime, "posterior": a.posterior, "steps": a.steps,
                                                 "base_gate_passes": gate["passes"], "cells": results}, indent=1))


if __name__ == "__main__":
    main()
