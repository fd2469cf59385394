"""How uneven each base's surprisal is: its profile (`surprisal_profile`: mean b_t, coefficient of variation, share of the total on
the top tenth of the tokens) over the response tokens of held-out examples of its own task, drawn as a run with that base draws them
(`resolve_config`, `prepare_run`: the same split, the same cached b_t). Every shipped base, and with --collections every base a
committed collection keeps of its own (`reference/NAME/bases/*`, e.g. the entropy study's surface-form levels).

    python benchmarks/base_profiles.py --out reference/base-profiles/profiles.csv
    python benchmarks/base_profiles.py --bases none --collections entropy --out reference/base-profiles/collections.csv

Figures are printed and written, never asserted.
"""
import argparse
import csv
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import torch

from basedirected.config import pretrained_overrides, resolve_config
from basedirected.pretrained import BASE_FILES, catalogue
from basedirected.tasks import task_from_dict
from basedirected.runs import prepare_run
from basedirected.surprisal import surprisal_profile

FIELDS = ("base", "task", "n_eval", "tokens", "b_mean", "b_cv", "b_top10_share", "seconds")
ROOT = Path(__file__).resolve().parents[1]


def base_profile(name: str, n_eval: int) -> dict:
    "The profile of shipped base `name` over the response tokens of `n_eval` held-out examples of its task."
    t0 = time.perf_counter()
    config = resolve_config(shipped_base=name, overrides={"n_eval": n_eval})
    with tempfile.TemporaryDirectory() as d:
        held = prepare_run(Path(d) / "run", config, device="cpu", base_from=name).eval_cache
        tokens = held.values.cpu()[torch.arange(held.values.shape[1])[None, :] < held.lengths.cpu()[:, None]]
    return {"base": name, "task": config.task.name, "n_eval": n_eval, "tokens": tokens.numel(), **surprisal_profile(tokens),
            "seconds": round(time.perf_counter() - t0, 1)}


def collection_base_profile(collection: str, base_dir: Path, n_eval: int) -> dict:
    "The profile of a base a collection keeps (`reference/<collection>/bases/<name>`), read as a run of its recipe reads it: never trained again."
    t0 = time.perf_counter()
    key = {k: v for k, v in torch.load(base_dir / "base.pt", weights_only=True).items() if k != "model"}
    config = resolve_config(task_from_dict(key["task"]), overrides={**pretrained_overrides(key), "n_eval": n_eval})
    digest = hashlib.sha256((base_dir / "base.pt").read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"; run.mkdir()
        for name in BASE_FILES:
            if (base_dir / name).is_file(): shutil.copy(base_dir / name, run / name)
        held = prepare_run(run, config, device="cpu").eval_cache
        if hashlib.sha256((run / "base.pt").read_bytes()).hexdigest() != digest: raise RuntimeError(f"{base_dir}: the run did not read this base")
        tokens = held.values.cpu()[torch.arange(held.values.shape[1])[None, :] < held.lengths.cpu()[:, None]]
    return {"base": f"{collection}/{base_dir.name}", "task": config.task.name, "n_eval": n_eval, "tokens": tokens.numel(), **surprisal_profile(tokens),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bases", default="", help="comma-separated shipped bases (default: every one; none: no shipped base)")
    p.add_argument("--collections", default="", help="comma-separated committed collections whose own bases (reference/NAME/bases/*) are profiled too")
    p.add_argument("--n-eval", type=int, default=512, help="held-out examples per base")
    p.add_argument("--out", required=True, help="the CSV to write")
    a = p.parse_args(argv)
    names = [] if a.bases == "none" else [n for n in a.bases.split(",") if n] or sorted(catalogue())
    rows = [base_profile(n, a.n_eval) for n in names]
    for c in (c for c in a.collections.split(",") if c):
        rows += [collection_base_profile(c, d, a.n_eval) for d in sorted((ROOT / "reference" / c / "bases").iterdir()) if (d / "base.pt").is_file()]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS); w.writeheader(); w.writerows(rows)
    for r in rows:
        print(f"{r['base']:30s} {r['tokens']:6d} tokens  mean b_t {r['b_mean']:.3f} nats  CV {r['b_cv']:.2f}  top-10 % share {r['b_top10_share']:.3f}  ({r['seconds']} s)")


if __name__ == "__main__":
    main()
