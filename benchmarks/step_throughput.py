"""Training-step throughput of one CVAE run, and what the objective's bookkeeping costs.

Prints, for the quick and paper model sizes on the current device: milliseconds per step and examples per second of
(a) the package's training step (`train_step`: every reconstruction term, the KL, the exact or amortized posterior, one
log record with every term as a Python float), (b) a plain token-mean cELBO step on the same model and batch (one
loss, one synced float), and (c) the package's step with the frozen reference recomputed every step instead of the
cache. Ratios are within one run of this script, so machine noise affects them less than the absolute figures.

    python benchmarks/step_throughput.py [--steps 30] [--out bench.json]

The base model is randomly initialized (throughput does not depend on training); nothing is written unless --out.
"""
import argparse
import dataclasses
import json
import platform
import tempfile
import time

import torch

from basedirected.base import BaseTrainConfig
from basedirected.cvae import CVAEConfig, build_cvae, cvae_forward
from basedirected.model import ModelConfig, TinyCausalLM
from basedirected.runs import Run, RunConfig, RunDir, TrainConfig, resolve_device, run_vocab
from basedirected.surprisal import ReferenceScale
from basedirected.tasks import batch_indices, make_splits
from basedirected.train import train_step
from basedirected.visiting_order import VisitingOrder

SIZES = {"quick": (ModelConfig(), 32, 4), "paper": (ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=512), 64, 6)}


def make_run(size: str, posterior: str, device, recompute: bool = False) -> Run:
    model_cfg, batch, K = SIZES[size]
    cfg = RunConfig(n_train=4096, n_eval=64, base=BaseTrainConfig(model=model_cfg), cvae=CVAEConfig(K=K, posterior=posterior),
                    train=TrainConfig(batch_size=batch, recompute_reference=recompute))
    vocab = run_vocab(cfg)
    train, held_out = make_splits(cfg.task, cfg.n_train, cfg.n_eval, seed=0)
    torch.manual_seed(0)
    base = TinyCausalLM(len(vocab), model_cfg).to(device).eval()
    model = build_cvae(base, vocab, cfg.cvae).to(device)
    return Run(RunDir(tempfile.mkdtemp()), cfg, device, vocab, train, held_out, base, ReferenceScale(0.3, 0.01, 100, "model"), model)


def plain_celbo_step(run: Run, opt, step: int, beta: float) -> float:
    "A token-mean cELBO step with nothing else: one loss, one synced float."
    idx = batch_indices(len(run.train), run.config.train.batch_size, 0, step)
    exs = [run.train[i] for i in idx]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.device.type == "cuda"):
        out = cvae_forward(run.model, exs)
    mask = out.mask
    loss = ((out.nll.float() * mask).sum(-1) / mask.sum(-1)).mean() + beta * out.kl.mean()
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return loss.item()


def timed(fn, steps: int, warmup: int = 5) -> float:
    for s in range(warmup): fn(s)
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps): fn(s)
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30); p.add_argument("--device", default="auto"); p.add_argument("--out", default=None)
    a = p.parse_args()
    device = resolve_device(a.device)
    rows = []
    for size in SIZES:
        for posterior in ("exact", "amortized"):
            run = make_run(size, posterior, device)
            run.train_cache  # built once, outside the timing
            opt = torch.optim.AdamW(run.model.parameters(), lr=1e-4)
            full = timed(lambda s: json.dumps(train_step(run, opt, s, 0.1, 1e-4)), a.steps)
            plain = timed(lambda s: plain_celbo_step(run, opt, s, 0.1), a.steps) if posterior == "amortized" else float("nan")
            rec = make_run(size, posterior, device, recompute=True)
            opt_r = torch.optim.AdamW(rec.model.parameters(), lr=1e-4)
            recompute = timed(lambda s: json.dumps(train_step(rec, opt_r, s, 0.1, 1e-4)), a.steps)
            batch = run.config.train.batch_size
            rows.append({"size": size, "posterior": posterior, "batch": batch, "K": run.config.cvae.K,
                         "ms_per_step": 1e3 * full, "examples_per_s": batch / full, "plain_celbo_ms": 1e3 * plain,
                         "bookkeeping_overhead": full / plain - 1 if plain == plain else None,
                         "recompute_reference_ms": 1e3 * recompute, "recompute_overhead": recompute / full - 1})
            r = rows[-1]
            print(f"{size:5s} {posterior:9s} batch {batch:3d} K {r['K']}: {r['ms_per_step']:7.1f} ms/step, {r['examples_per_s']:7.0f} examples/s"
                  + (f"; plain cELBO {r['plain_celbo_ms']:.1f} ms (loss stack + KL + logging +{100 * r['bookkeeping_overhead']:.1f}%)" if r["bookkeeping_overhead"] is not None else "")
                  + f"; reference recomputed every step +{100 * r['recompute_overhead']:.1f}%")
    env = {"device": str(device), "cuda": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version()}
    print(json.dumps(env))
    if a.out: json.dump({"rows": rows, "environment": env, "steps": a.steps}, open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
