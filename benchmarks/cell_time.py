"""Where a whole sorting cell's time goes, what this revision's changes buy, and how a run fares beside another job.

1. Two cells of the settled preset's sorting arm (J_theta at tau 0.07, 700 CVAE steps, 10 held-out evaluations, one thread, the
   metrics; CVAE seeds 0 and 1) adapted from the shipped base sorting-s0, one after the other in one process as a sweep's worker
   trains them, each timed phase by phase against each phase's FLOPs (2 x parameters x tokens a forward pass, 6 x a training step).
   "before": subnormal floats kept and the training split's b_t computed again for every cell, as every run did before
   `flush_subnormals` and `shared_surprisal`; "now": this revision. Each arm in a fresh process, both in this one invocation.
   Printed: the second cell's seconds (the sweep's steady state) and GFLOP/s per phase, the ratio before/now, cells per hour on
   2 cores, and both arms' primary figures (flushing subnormals changes results at round-off; the figures say how far).
2. Steps of the default run (two threads) idle and beside one other two-thread job (a torch matmul loop), under OpenMP's default
   waiting and under the commands' own (`basedirected.launch.THREAD_WAITING`), each in a fresh process.

    python benchmarks/cell_time.py [--steps 700] [--load-steps 60] [--out cell_time.json]

Quote its figures only from an idle machine; compare within one invocation.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CELL = r'''
import dataclasses, json, sys, time, tempfile
from pathlib import Path
import basedirected.runs as R
import basedirected.train as T
from basedirected.presets import PRESETS, plan
from basedirected.runs import prepare_run
steps, now = int(sys.argv[1]), sys.argv[2] == "1"
out = []
for seed in (0, 1):
    spec = next(s for s in plan(PRESETS["settled"]) if s.regime == "sorting" and s.objective == "theta" and s.alpha == 0.5 and s.config.data_seed == 0 and s.seed == seed)
    cfg = dataclasses.replace(spec.config, flush_subnormals=now, train=dataclasses.replace(spec.config.train, steps=steps,
                              eval_every=max(steps // 10, 1), checkpoint_every=max(steps // 10, 1)))
    if not now: R._SURPRISAL_CACHES.clear()  # before: every cell computed its training split's b_t
    spent = {"evaluations": 0.0}
    real = T._evaluate_at
    def timed(r, step, real=real):
        t0 = time.perf_counter(); o = real(r, step); spent["evaluations"] += time.perf_counter() - t0; return o
    T._evaluate_at = timed
    d = Path(tempfile.mkdtemp()) / "cell"
    t0 = time.perf_counter(); r = prepare_run(d, cfg, device="cpu"); r.gate; t1 = time.perf_counter()
    r.train_cache; r.train_rows; r.eval_cache; r.eval_rows; t2 = time.perf_counter()
    final = T.train_run(r); t3 = time.perf_counter()
    m = T.complete(r, final); t4 = time.perf_counter()
    T._evaluate_at = real
    P = sum(p.numel() for p in r.model.generator.parameters())
    tokens = sum(len(e.y) + 3 + len(e.x) + 6 for e in r.train) / len(r.train)  # a generator row: the prompt, the code block and the response
    rows_step = cfg.train.batch_size * cfg.cvae.K
    out.append({"prepare": t1 - t0, "caches": t2 - t1, "steps": t3 - t2 - spent["evaluations"], "evaluations": spent["evaluations"], "metrics": t4 - t3,
                "flop": {"caches": 2 * P * tokens * (len(r.train) + len(r.held_out)), "steps": 6 * P * tokens * rows_step * steps,
                         "evaluations": 2 * P * tokens * len(r.held_out) * cfg.cvae.K * (steps // max(steps // 10, 1) + 1)},
                "figures": {k: m.get(k) for k in ("rate", "gen_alignment_controlled_all", "gen_answer_rate", "alignment_posterior", "eval_loss", "settled")}})
print(json.dumps(out))
'''
STEPS = r'''
import sys, time, tempfile
from pathlib import Path
from basedirected.runs import prepare_run
from basedirected.config import resolve_config
from basedirected.train import OneRun
r = prepare_run(Path(tempfile.mkdtemp()) / "run", resolve_config(overrides={"threads": 2}), device="cpu"); r.train_cache; r.train_rows
s = OneRun([r]); n = int(sys.argv[1])
for i in range(10): s.step(i)
t0 = time.perf_counter()
for i in range(10, 10 + n): s.step(i)
print((time.perf_counter() - t0) / n * 1000)
'''
BURN = "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True: a = (a @ a).tanh()"


def child(code, *args, env=None):
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)
    if p.returncode: raise SystemExit(p.stderr)
    return p.stdout.strip().splitlines()[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=700); ap.add_argument("--load-steps", type=int, default=60); ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="cell,load", help="which parts to run: cell, load or both")
    a = ap.parse_args()
    from basedirected.launch import THREAD_WAITING, WAITING_SET_BY_USER
    from basedirected.machine import cpu_model
    plain = {k: v for k, v in os.environ.items() if k not in WAITING_SET_BY_USER}
    both, load = {}, {}
    print(f"{cpu_model()}, {os.cpu_count()} cores")
    if "cell" in a.parts: both = cell_part(a, plain, THREAD_WAITING)
    if "load" in a.parts: load = load_part(a, plain, THREAD_WAITING)
    if a.out: open(a.out, "w").write(json.dumps({"cpu": cpu_model(), "cells": both, "load": load}, indent=1))


def cell_part(a, plain, THREAD_WAITING):
    print(f"\n1. two settled sorting cells ({a.steps} steps) in one process, one thread: the second cell, before and now")
    both = {label: json.loads(child(CELL, a.steps, flag, env={**plain, **THREAD_WAITING})) for label, flag in (("before", 0), ("now", 1))}
    cells = {label: runs[1] for label, runs in both.items()}
    phases = ("prepare", "caches", "steps", "evaluations", "metrics")
    print(f"  {'phase':<12}" + "".join(f"{l + ' s':>12}{l + ' GFLOP/s':>18}" for l in cells) + f"{'before/now':>12}")
    for ph in phases:
        row = f"  {ph:<12}"
        for l, c in cells.items():
            f = c["flop"].get(ph)
            row += f"{c[ph]:>12.1f}" + (f"{f / c[ph] / 1e9:>18.2f}" if f and c[ph] > 0.05 else f"{'':>18}")
        print(row + (f"{cells['before'][ph] / cells['now'][ph]:>12.2f}" if cells["now"][ph] > 0.05 else f"{'':>12}"))
    total = {l: sum(c[ph] for ph in phases) for l, c in cells.items()}
    print(f"  {'whole cell':<12}" + "".join(f"{t:>12.1f}{'':>18}" for t in total.values()) + f"{total['before'] / total['now']:>12.2f}")
    print(f"  cells per hour on 2 cores (2 workers, one thread each): before {2 * 3600 / total['before']:.0f}, now {2 * 3600 / total['now']:.0f}"
          f"  (the first cell of a worker, which computes b_t: {sum(both['now'][0][ph] for ph in phases):.1f} s now)")
    for l, runs in both.items():
        for seed, c in enumerate(runs): print(f"  figures, {l}, seed {seed}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in c["figures"].items()))
    return both


def load_part(a, plain, THREAD_WAITING):
    print(f"\n2. the default run's steps ({a.load_steps} steps, two threads), ms a step")
    load = {}
    for label, env in (("OpenMP's default waiting", plain), ("the commands' waiting", {**plain, **THREAD_WAITING})):
        idle = float(child(STEPS, a.load_steps, env=env))
        burner = subprocess.Popen([sys.executable, "-c", BURN]); time.sleep(1.0)
        try: loaded = float(child(STEPS, a.load_steps, env=env))
        finally: burner.kill(); burner.wait()
        load[label] = {"idle_ms": idle, "beside_a_2_thread_job_ms": loaded}
        print(f"  {label:<26} idle {idle:7.1f}   beside one other 2-thread job {loaded:7.1f}")
    return load


if __name__ == "__main__":
    main()
