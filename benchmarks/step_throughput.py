"""Training-step throughput of one CVAE run, and what the objective's bookkeeping costs.

Prints, for the quick and paper model sizes on the current device, milliseconds per step, examples/s, run-steps/min and
tokens/s of:
  step        the package's training step (`train_step`: device-resident data, every reconstruction term, the KL, the exact
              or amortized posterior, one host sync carrying every logged term);
  collated    the same step with the minibatch collated from Python `Example` lists every step (the old data path);
  plain       a token-mean cELBO step on the same model and batch (one loss, one synced float): the bookkeeping baseline;
  recompute   the step with the frozen reference run every step instead of the cache;
  shared      the step with shared-prefix enumeration of the K codes (the prompt once, a packed sequence);
  compiled    (CUDA, or --compile) the step with the backbones under `torch.compile`; the compile time is reported apart.
On CUDA it also prints the peak memory, host synchronizations per step (`torch.cuda.set_sync_debug_mode`), and the model
FLOP utilisation: 6 x backbone parameters x tokens per step, against the chip's dense bf16 peak (--peak-tflops, known
for H100/H200). Ratios are within one run of this script, so machine noise affects them less than absolute figures.
Then, for groups of N runs trained in one process (`basedirected.groups.RunGroup`: stacked parameters, one vmapped step,
AdamW per run; the runs differ in beta and code noise), milliseconds per group step, run-steps/min (N steps per group
step), examples/s, tokens/s, model TFLOP/s and its share of the dense bf16 peak, and peak memory, for every group size in
every precision (bf16 and float32 on CUDA), eager and compiled (on CUDA, or --compile), with the compile time; then, for
the largest group, attention left to vmap's batching (unfolded) and shared-prefix enumeration (a masked attention).
On one GPU, the groups alone:

    python benchmarks/step_throughput.py --parts groups --out groups.json

    python benchmarks/step_throughput.py [--steps 30] [--device auto] [--compile] [--group-sizes 1,64,128,256] [--out bench.json]

The base model is randomly initialized (throughput does not depend on training); nothing is written unless --out.
"""
import argparse
import dataclasses
import json
import platform
import tempfile
import time
import warnings

import torch

from basedirected.base import BaseTrainConfig
from basedirected.cvae import CVAEConfig, build_cvae, cvae_forward, exact_objective
from basedirected.groups import RunGroup
from basedirected.objective import BetaSchedule
from basedirected.model import ModelConfig, TinyCausalLM, as_rows
from basedirected.runs import Run, RunDir, run_vocab
from basedirected.machine import resolve_device
from basedirected.config import RunConfig, TrainConfig
from basedirected.surprisal import ReferenceScale
from basedirected.tasks import batch_indices, make_splits
from basedirected.train import compile_cvae, train_step

SIZES = {"quick": (ModelConfig(), 32, 4), "paper": (ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=512), 64, 6)}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, vendor figures


def make_run(size: str, posterior: str, device, recompute: bool = False) -> Run:
    model_cfg, batch, K = SIZES[size]
    cfg = RunConfig(n_train=4096, n_eval=64, base=BaseTrainConfig(model=model_cfg), cvae=CVAEConfig(K=K, posterior=posterior),
                    train=TrainConfig(batch_size=batch, recompute_reference=recompute))
    vocab = run_vocab(cfg)
    train, held_out = make_splits(cfg.task, cfg.n_train, cfg.n_eval, seed=0)
    torch.manual_seed(0)
    base = TinyCausalLM(len(vocab), model_cfg).to(device).eval()
    model = build_cvae(base, vocab, cfg.cvae).to(device)
    run = Run(RunDir(tempfile.mkdtemp()), cfg, device, vocab, train, held_out, base, ReferenceScale(0.3, 0.01, 100, "model"), model)
    run.train_cache, run.train_rows  # built once, outside the timing
    return run


def group_of(run: Run, n: int) -> RunGroup:
    "`n` runs sharing `run`'s base and data, each with its own CVAE (code noise seed) and beta."
    runs = []
    for i in range(n):
        torch.manual_seed(i)
        cfg = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, beta=BetaSchedule(beta=0.02 * (1 + i % 8))))
        r = Run(run.dir, cfg, run.device, run.vocab, run.train, run.held_out, run.base, run.scale,
                build_cvae(run.base, run.vocab, cfg.cvae, seed=i).to(run.device))
        r.__dict__.update(train_cache=run.train_cache, train_rows=run.train_rows)  # shared: built once
        runs.append(r)
    return runs


class CollatingRows:
    "The old data path: every step collates its `Example` list in Python and copies it to the device."
    def __init__(self, run: Run): self.run = run
    def __len__(self): return len(self.run.train)
    def select(self, idx): return as_rows(self.run.vocab, [self.run.train[i] for i in idx], self.run.device)


def plain_celbo_step(run: Run, opt, step: int, beta: float) -> float:
    "A token-mean cELBO step with nothing else: one loss, one synced float."
    rows = run.train_rows.select(batch_indices(len(run.train), run.config.train.batch_size, 0, step))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.device.type == "cuda"):
        out = cvae_forward(run.model, rows)
    mask = out.mask
    if out.nll is None:  # exact posterior: the cELBO at q*, -beta log sum_k r_k exp(-L_k / beta) with token-mean L_k
        code_loss = (out.nll_per_code.float() * mask[:, None]).sum(-1) / mask.sum(-1)[:, None]
        loss = exact_objective(code_loss, out.r_logits, beta).mean()
    else: loss = ((out.nll.float() * mask).sum(-1) / mask.sum(-1)).mean() + beta * out.kl.mean()
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return loss.item()


def sync(device):
    if device.type == "cuda": torch.cuda.synchronize()


def timed(fn, steps: int, device, warmup: int = 5) -> float:
    for s in range(warmup): fn(s)
    sync(device)
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps): fn(s)
    sync(device)
    return (time.perf_counter() - t0) / steps


def tokens_per_step(run: Run, steps: int = 20) -> float:
    "Mean real tokens one step runs through a backbone: K (or n_samples) generator rows per example, plus the posterior's row."
    c = run.config.cvae
    gen_rows = c.K if c.latent == "discrete" else c.n_samples
    post = 0 if c.posterior == "exact" else 1
    n = 0
    for s in range(steps):
        idx = batch_indices(len(run.train), run.config.train.batch_size, 0, s)
        n += gen_rows * int(run.train_rows.gen_len[idx].sum()) + post * int(run.train_rows.base_len[idx].sum())
    return n / steps


def syncs_per_step(run: Run, opt, steps: int = 4) -> float:
    "Host synchronizations per training step, counted by CUDA's sync debug mode."
    sync(run.device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(steps): train_step(run, [opt], 1000 + s, 0.1, 1e-4)
    finally: torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30); p.add_argument("--device", default="auto"); p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="also time compiled backbones (default on CUDA)")
    p.add_argument("--sizes", default="quick,paper"); p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--group-sizes", default=None, help="runs per group (default: 1,64,128,256 on CUDA, 1,4 on a CPU)")
    p.add_argument("--precisions", default=None, help="the group step's precisions (default: bfloat16,float32 on CUDA, float32 on a CPU)")
    p.add_argument("--compiled-groups", default=None, help="group sizes also timed compiled: a list or 'all' (default: all on CUDA or with --compile, none on a CPU)")
    p.add_argument("--group-variants", default=None, help="also timed for the largest group in the first precision: "
                   "unfolded (vmap batches attention itself), shared (shared-prefix enumeration: a masked attention), "
                   "cudagraphs (compiled with mode reduce-overhead) (default: all three on CUDA, the first two on a CPU)")
    p.add_argument("--attention-variants", default="", help="SDPA backends (flash, cudnn, efficient, math) also timed for the largest group")
    p.add_argument("--parts", default="single,groups", help="what to time: single (one run, every variant), groups (N-run groups)")
    a = p.parse_args()
    device = resolve_device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = a.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if name and k in name), None)
    do_compile = a.compile or device.type == "cuda"
    rows = []
    for size in (a.sizes.split(",") if "single" in a.parts else []):
        for posterior in ("exact", "amortized"):
            run = make_run(size, posterior, device)
            opt = torch.optim.AdamW(run.model.parameters(), lr=1e-4)
            if device.type == "cuda": torch.cuda.reset_peak_memory_stats(device)
            full = timed(lambda s: json.dumps(train_step(run, [opt], s, 0.1, 1e-4)), a.steps, device)
            peak_mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            n_sync = syncs_per_step(run, opt) if device.type == "cuda" else None
            plain = timed(lambda s: plain_celbo_step(run, opt, s, 0.1), a.steps, device)
            fast_rows, run.train_rows = run.train_rows, CollatingRows(run)
            collated = timed(lambda s: json.dumps(train_step(run, [opt], s, 0.1, 1e-4)), a.steps, device)
            run.train_rows = fast_rows
            run.model.shared_prefix = True
            shared = timed(lambda s: json.dumps(train_step(run, [opt], s, 0.1, 1e-4)), a.steps, device)
            run.model.shared_prefix = False
            rec = make_run(size, posterior, device, recompute=True)
            opt_r = torch.optim.AdamW(rec.model.parameters(), lr=1e-4)
            recompute = timed(lambda s: json.dumps(train_step(rec, [opt_r], s, 0.1, 1e-4)), a.steps, device)
            compiled = compile_s = None
            if do_compile:
                comp = make_run(size, posterior, device)
                compile_cvae(comp.model)
                opt_c = torch.optim.AdamW(comp.model.parameters(), lr=1e-4)
                t0 = time.perf_counter(); train_step(comp, [opt_c], 0, 0.1, 1e-4); sync(device)
                compile_s = time.perf_counter() - t0  # first step: tracing and code generation
                compiled = timed(lambda s: json.dumps(train_step(comp, [opt_c], s, 0.1, 1e-4)), a.steps, device, warmup=10)
            batch, tokens = run.config.train.batch_size, tokens_per_step(run)
            params = sum(p.numel() for m in (run.model.generator, run.model.posterior) for p in m.parameters()) / 2  # one backbone
            flops = 6 * params * tokens  # forward and backward, weights only (attention and heads are small here)
            r = {"size": size, "posterior": posterior, "batch": batch, "K": run.config.cvae.K, "tokens_per_step": tokens,
                 "ms_per_step": 1e3 * full, "examples_per_s": batch / full, "run_steps_per_min": 60 / full, "tokens_per_s": tokens / full,
                 "collated_ms": 1e3 * collated, "device_data_speedup": collated / full,
                 "plain_celbo_ms": 1e3 * plain, "bookkeeping_overhead": full / plain - 1,
                 "recompute_reference_ms": 1e3 * recompute, "recompute_overhead": recompute / full - 1,
                 "shared_prefix_ms": 1e3 * shared, "shared_prefix_speedup": full / shared,
                 "compiled_ms": None if compiled is None else 1e3 * compiled, "compile_s": compile_s,
                 "model_tflops": flops / full / 1e12, "mfu": flops / full / 1e12 / peak if peak else None,
                 "peak_memory_mib": peak_mem, "syncs_per_step": n_sync}
            rows.append(r)
            print(f"{size:5s} {posterior:9s} batch {batch:3d} K {r['K']}: {r['ms_per_step']:7.2f} ms/step, {r['examples_per_s']:7.0f} examples/s, "
                  f"{r['run_steps_per_min']:7.0f} run-steps/min, {r['tokens_per_s']:9.0f} tokens/s; collated data {r['collated_ms']:.2f} ms "
                  f"(device-resident {r['device_data_speedup']:.2f}x); plain cELBO {r['plain_celbo_ms']:.2f} ms (loss stack + KL + logging "
                  f"{100 * r['bookkeeping_overhead']:+.1f}%); reference recomputed {100 * r['recompute_overhead']:+.1f}%; "
                  f"shared prefix {r['shared_prefix_ms']:.2f} ms ({r['shared_prefix_speedup']:.2f}x)"
                  + (f"; compiled {r['compiled_ms']:.2f} ms ({full / compiled:.2f}x, compile {compile_s:.0f} s)" if compiled else "")
                  + (f"; {r['model_tflops']:.2f} TFLOP/s" + (f" = {100 * r['mfu']:.2f}% of {peak:.0f}" if peak else "") if device.type == "cuda" else "")
                  + (f"; peak memory {peak_mem:.0f} MiB; {n_sync:.1f} host syncs/step" if device.type == "cuda" else ""), flush=True)
    groups = []
    cuda = device.type == "cuda"
    sizes_n = [int(n) for n in (a.group_sizes or ("1,64,128,256" if cuda else "1,4")).split(",")] if "groups" in a.parts else []
    precisions = (a.precisions or ("bfloat16,float32" if cuda else "float32")).split(",")
    compiled_ns = sizes_n if a.compiled_groups == "all" else [int(n) for n in a.compiled_groups.split(",") if n] if a.compiled_groups else (sizes_n if do_compile else [])
    extra = a.group_variants if a.group_variants is not None else "unfolded,shared,cudagraphs" if cuda else "unfolded,shared"
    unknown = set(extra.split(",")) - {"unfolded", "shared", "cudagraphs", ""}
    if unknown: p.error(f"--group-variants must be among unfolded, shared, cudagraphs, got {sorted(unknown)[0]!r}")
    for size in a.sizes.split(",") if sizes_n else []:
        run = make_run(size, "exact", device)
        tokens = tokens_per_step(run)
        params = sum(p.numel() for p in run.model.generator.parameters())
        # every size in every precision, eager and (where asked) compiled; then, for the largest group in the first precision,
        # vmap's own batching of attention (unfolded), shared-prefix enumeration (a masked attention) and restricted SDPA backends
        variants = [dict(runs=n, precision=pr, compiled=c) for pr in precisions for n in sizes_n for c in ((False, True) if n in compiled_ns else (False,))]
        top = dict(runs=max(sizes_n), precision=precisions[0], compiled=False)
        variants += [{**top, "variant": v, "compiled": v == "cudagraphs"} for v in extra.split(",") if v]
        variants += [{**top, "variant": v, "attention": (v,)} for v in a.attention_variants.split(",") if v]
        for v in variants:
            n, compiled, label = v["runs"], v["compiled"], v.get("variant", "compiled" if v["compiled"] else "eager")
            if cuda: torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(device)
            try:
                members = group_of(run, n)
                if label == "shared":
                    for r in members: r.model.shared_prefix = True
                group = RunGroup(members, compile="reduce-overhead" if label == "cudagraphs" else compiled, precision=v["precision"], fold_attention=label != "unfolded",
                                 **({"attention": v["attention"]} if "attention" in v else {}))
                t0 = time.perf_counter(); group.step(0); sync(device)
                first = time.perf_counter() - t0  # compiled: tracing and code generation
                t = timed(lambda s: json.dumps(group.step(s)), a.steps, device, warmup=10 if compiled else 3)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a size the device cannot take: said, not fatal
                print(f"{size:5s} group of {n:4d} {v['precision']:8s} {label:9s}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                groups.append({"size": size, **v, "variant": label, "error": str(e).splitlines()[0][:500]})
                group = None; continue
            g = {"size": size, "posterior": "exact", **v, "variant": label, "compile_s": first if compiled else None,
                 "ms_per_group_step": 1e3 * t, "run_steps_per_min": 60 * n / t, "examples_per_s": n * run.config.train.batch_size / t,
                 "tokens_per_s": n * tokens / t, "model_tflops": 6 * params * tokens * n / t / 1e12,
                 "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}
            g["mfu"] = g["model_tflops"] / peak if peak else None
            groups.append(g)
            print(f"{size:5s} group of {n:4d} {v['precision']:8s} {label:9s}: {g['ms_per_group_step']:8.2f} ms/group step, "
                  f"{g['run_steps_per_min']:9.0f} run-steps/min, {g['examples_per_s']:9.0f} examples/s, {g['tokens_per_s']:11.0f} tokens/s, "
                  f"{g['model_tflops']:.2f} TFLOP/s" + (f" = {100 * g['mfu']:.2f}% of the bf16 peak" if peak else "")
                  + (f"; compile {first:.0f} s" if compiled else "")
                  + (f"; peak memory {g['peak_memory_mib'] / 1024:.1f} GiB" if cuda else ""), flush=True)
            del group
    env = {"device": str(device), "cuda": name, "peak_bf16_tflops": peak, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version()}
    print(json.dumps(env))
    if a.out: json.dump({"rows": rows, "groups": groups, "environment": env, "steps": a.steps}, open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
