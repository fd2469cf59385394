"""How uneven each shipped base's surprisal is: its profile (`surprisal_profile`: mean b_t, coefficient of variation, share of the
total on the top tenth of the tokens) over the response tokens of held-out examples of its own task, drawn as a run with that base
draws them (`resolve_config(shipped_base=...)`, `prepare_run`: the same split, the same cached b_t).

    python benchmarks/base_profiles.py --out reference/base-profiles/profiles.csv

Figures are printed and written, never asserted.
"""
import argparse
import csv
import tempfile
import time
from pathlib import Path

import torch

from basedirected.config import resolve_config
from basedirected.pretrained import catalogue
from basedirected.runs import prepare_run
from basedirected.surprisal import surprisal_profile

FIELDS = ("base", "task", "n_eval", "tokens", "b_mean", "b_cv", "b_top10_share", "seconds")


def base_profile(name: str, n_eval: int) -> dict:
    "The profile of shipped base `name` over the response tokens of `n_eval` held-out examples of its task."
    t0 = time.perf_counter()
    config = resolve_config(shipped_base=name, overrides={"n_eval": n_eval})
    with tempfile.TemporaryDirectory() as d:
        held = prepare_run(Path(d) / "run", config, device="cpu", base_from=name).eval_cache
        tokens = held.values.cpu()[torch.arange(held.values.shape[1])[None, :] < held.lengths.cpu()[:, None]]
    return {"base": name, "task": config.task.name, "n_eval": n_eval, "tokens": tokens.numel(), **surprisal_profile(tokens),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bases", default="", help="comma-separated shipped bases (default: every one)")
    p.add_argument("--n-eval", type=int, default=512, help="held-out examples per base")
    p.add_argument("--out", required=True, help="the CSV to write")
    a = p.parse_args(argv)
    names = [n for n in a.bases.split(",") if n] or sorted(catalogue())
    rows = [base_profile(n, a.n_eval) for n in names]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS); w.writeheader(); w.writerows(rows)
    for r in rows:
        print(f"{r['base']:24s} {r['tokens']:6d} tokens  mean b_t {r['b_mean']:.3f} nats  CV {r['b_cv']:.2f}  top-10 % share {r['b_top10_share']:.3f}  ({r['seconds']} s)")


if __name__ == "__main__":
    main()
