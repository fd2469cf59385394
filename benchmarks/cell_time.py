"""Where a whole sorting cell's time goes, what flushing subnormal floats buys, and how a run fares beside another job.

1. A cell of the settled preset's sorting arm (J_theta at tau 0.07, 700 CVAE steps, 10 held-out evaluations, one thread, the
   metrics) adapted from the shipped base sorting-s0, timed phase by phase against each phase's FLOPs (2 x parameters x tokens
   a forward pass, 6 x a training step): subnormals kept (every run before `flush_subnormals` existed) and flushed, each in a
   fresh process, in this one invocation. Printed: seconds, GFLOP/s per phase, the ratio kept/flushed, cells per hour, and the
   primary figures of both (flushing changes results at round-off, so a trained figure may move; the figures say how far).
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
import json, sys, time, tempfile
from pathlib import Path
import basedirected.train as T
from basedirected.experiments import PRESETS, plan
from basedirected.runs import prepare_run
steps, flush = int(sys.argv[1]), sys.argv[2] == "1"
spec = next(s for s in plan(PRESETS["settled"]) if s.regime == "sorting" and s.objective == "theta" and s.alpha == 0.5 and s.config.data_seed == 0 and s.seed == 0)
import dataclasses
cfg = dataclasses.replace(spec.config, flush_subnormals=flush, train=dataclasses.replace(spec.config.train, steps=steps,
                          eval_every=max(steps // 10, 1), checkpoint_every=max(steps // 10, 1)))
spent = {"evaluations": 0.0}
real = T._evaluate_at
def timed(r, step):
    t0 = time.perf_counter(); out = real(r, step); spent["evaluations"] += time.perf_counter() - t0; return out
T._evaluate_at = timed
d = Path(tempfile.mkdtemp()) / "cell"
t0 = time.perf_counter(); r = prepare_run(d, cfg, device="cpu"); r.gate; t1 = time.perf_counter()
r.train_cache; r.train_rows; r.eval_cache; r.eval_rows; t2 = time.perf_counter()
final = T.train_run(r); t3 = time.perf_counter()
m = T.complete(r, final); t4 = time.perf_counter()
P = sum(p.numel() for p in r.model.generator.parameters())
tokens = sum(len(e.y) + 3 + len(e.x) + 6 for e in r.train) / len(r.train)  # a generator row: the prompt, the code block and the response
rows_step = cfg.train.batch_size * cfg.cvae.K
print(json.dumps({"prepare": t1 - t0, "caches": t2 - t1, "steps": t3 - t2 - spent["evaluations"], "evaluations": spent["evaluations"], "metrics": t4 - t3,
                  "flop": {"caches": 2 * P * tokens * (len(r.train) + len(r.held_out)), "steps": 6 * P * tokens * rows_step * steps,
                           "evaluations": 2 * P * tokens * len(r.held_out) * cfg.cvae.K * (steps // max(steps // 10, 1) + 1)},
                  "figures": {k: m.get(k) for k in ("rate", "gen_alignment_controlled_all", "gen_answer_rate", "alignment_posterior", "eval_loss", "settled")}}))
'''
STEPS = r'''
import sys, time, tempfile
from pathlib import Path
from basedirected.runs import resolve_config, prepare_run
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
    a = ap.parse_args()
    from basedirected.launch import THREAD_WAITING, WAITING_SET_BY_USER
    from basedirected.runs import cpu_model
    plain = {k: v for k, v in os.environ.items() if k not in WAITING_SET_BY_USER}
    print(f"{cpu_model()}, {os.cpu_count()} cores\n\n1. a settled sorting cell ({a.steps} steps), subnormals kept vs flushed, one thread")
    cells = {label: json.loads(child(CELL, a.steps, flag, env={**plain, **THREAD_WAITING})) for label, flag in (("kept", 0), ("flushed", 1))}
    phases = ("prepare", "caches", "steps", "evaluations", "metrics")
    print(f"  {'phase':<12}" + "".join(f"{l + ' s':>12}{l + ' GFLOP/s':>18}" for l in cells) + f"{'kept/flushed':>14}")
    for ph in phases:
        row = f"  {ph:<12}"
        for l, c in cells.items():
            f = c["flop"].get(ph)
            row += f"{c[ph]:>12.1f}" + (f"{f / c[ph] / 1e9:>18.2f}" if f else f"{'':>18}")
        print(row + f"{cells['kept'][ph] / cells['flushed'][ph]:>14.2f}")
    total = {l: sum(c[ph] for ph in phases) for l, c in cells.items()}
    print(f"  {'whole cell':<12}" + "".join(f"{t:>12.1f}{'':>18}" for t in total.values()) + f"{total['kept'] / total['flushed']:>14.2f}")
    print(f"  cells per hour on 2 cores (2 workers, one thread each): kept {2 * 3600 / total['kept']:.0f}, flushed {2 * 3600 / total['flushed']:.0f}")
    for l, c in cells.items(): print(f"  figures, {l}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in c["figures"].items()))
    print(f"\n2. the default run's steps ({a.load_steps} steps, two threads), ms a step")
    load = {}
    for label, env in (("OpenMP's default waiting", plain), ("the commands' waiting", {**plain, **THREAD_WAITING})):
        idle = float(child(STEPS, a.load_steps, env=env))
        burner = subprocess.Popen([sys.executable, "-c", BURN]); time.sleep(1.0)
        try: loaded = float(child(STEPS, a.load_steps, env=env))
        finally: burner.kill(); burner.wait()
        load[label] = {"idle_ms": idle, "beside_a_2_thread_job_ms": loaded}
        print(f"  {label:<26} idle {idle:7.1f}   beside one other 2-thread job {loaded:7.1f}")
    if a.out: open(a.out, "w").write(json.dumps({"cpu": cpu_model(), "cells": cells, "load": load}, indent=1))


if __name__ == "__main__":
    main()
