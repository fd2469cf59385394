"""The settled preset's missing cells, at the revision that ran its other cells (67af351, which has no --only).

These are the steps of `basedirected.experiments._execute` at that revision (worker pool, CPU, one cell per pack),
restricted to the cells `<earlier>/summary.json` names missing. Bases are selected from those cells alone:
addition's arm needs 2 (data seeds 0 and 1), the learning-rate arm needs grid pathfinding's data seed 2,
and these are the bases the whole preset selected, provided each gate passes as before. The merge
(`basedirected-repro --collect --earlier`) refuses a base whose gate differs from the earlier collection's.

usage: PYTHONPATH=<worktree at 67af351> python settled_finish.py <out> <earlier collection> <jobs>
"""
import json, os, sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from basedirected import experiments as E

def main():
    out, earlier, jobs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    missing = json.loads((earlier / "summary.json").read_text())["missing"]
    preset = E.PRESETS["settled"]
    E.check_sweep_dir(out)
    specs = E.plan(preset)
    E.record_preset(out, preset)
    todo = [s for s in specs if s.key in set(missing)]
    assert len(todo) == len(missing), "a missing cell is not in the preset's plan"
    shared = {(s.regime, s.config.data_seed): s for s in todo}
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=E.die_with_parent, initargs=(os.getpid(),)) as pool:
        def prepare(keys):  # the shortest first, so that a base differing from the earlier one shows early
            futures = {k: pool.submit(E.prepare_shared_base, out, shared[k], "cpu") for k in sorted(keys, key=lambda k: shared[k].config.base.steps)}
            gates = [futures[k].result() for k in keys]
            for k, g in zip(keys, gates): print("base gated:", f"{k[0]}-s{k[1]}", "passes" if g["passes"] else "fails", flush=True)
            return gates
        usable = E.selected_bases(preset, todo, prepare)
        futures = [(s, pool.submit(E.run_pack, out, [s], "cpu", False, False)) for s in todo if usable[(s.regime, s.config.data_seed)]]
        for s, f in futures: f.result(); print("cell finished:", s.key, flush=True)
    print("skipped (base not usable):", [s.key for s in todo if not usable[(s.regime, s.config.data_seed)]])

if __name__ == "__main__": main()  # spawned workers import this file
