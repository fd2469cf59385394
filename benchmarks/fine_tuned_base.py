"""A base fine-tuned from a small GPT-2 on a task: the fine-tuning's time and the gate's figures.

A randomly initialised GPT-2 (a tokenizer trained on the task's text, nothing downloaded) is fine-tuned on the task's own examples as
`basedirected-train --backbone DIR --task NAME` does, then gated. The figures are printed and written as JSON, never asserted: they say
how far such a base gets, not that it passes.

    python benchmarks/fine_tuned_base.py --task sorting --width 64 --layers 2 --n-train 20000 --steps 4000 --batch-size 64 --lr 3e-3
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from basedirected.backbone import save_tiny_backbone, task_records
from basedirected.config import resolve_config
from basedirected.fine_tuning import prepare_fine_tuned_base
from basedirected.machine import cpu_model
from basedirected.runs import RunDir
from basedirected.tasks import make_task


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="sorting")
    p.add_argument("--arch", default="gpt2", choices=("gpt2", "qwen2"))
    p.add_argument("--tokenizer", default="word", choices=("word", "bpe"))
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--n-eval", type=int, default=256)
    p.add_argument("--steps", type=int, default=4000, help="fine-tuning steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mode", default="full", choices=("full", "lora"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    a = p.parse_args(argv)
    task = make_task(a.task)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = [r.prompt + " " + r.response for r in task_records(task, task.generate(200, seed=10_000 + a.seed))]
        save_tiny_backbone(tmp / "backbone", corpus, a.arch, d_model=a.width, n_layers=a.layers, seed=a.seed, tokenizer=a.tokenizer)
        config = resolve_config(a.task, backbone=str(tmp / "backbone"), overrides={
            "n_train": a.n_train, "n_eval": a.n_eval, "seed": a.seed, "fine_tune.steps": a.steps, "fine_tune.batch_size": a.batch_size,
            "fine_tune.lr": a.lr, "fine_tune.mode": a.mode})
        rd = RunDir(tmp / "run"); rd.path.mkdir()
        t0 = time.perf_counter()
        gate = prepare_fine_tuned_base(rd, config, "cpu", progress=False, require_gate=False)
        seconds = time.perf_counter() - t0
        record = json.loads((rd.fine_tuned / "fine_tune.json").read_text())
    figures = {"task": a.task, "arch": a.arch, "tokenizer": a.tokenizer, "width": a.width, "layers": a.layers, "n_train": a.n_train, "steps": a.steps,
               "batch_size": a.batch_size, "lr": a.lr, "mode": a.mode, "seconds": seconds, "first_loss": record["losses"][0], "final_loss": record["final_loss"],
               "gate": {k: gate[k] for k in ("answer_only_accuracy", "valid_rate", "strategy_gap", "surprisal_excess", "passes", "failures", "n_inputs")},
               "threads": torch.get_num_threads(), "cpu": cpu_model()}
    print(f"{a.arch} width {a.width} x {a.layers} layers, {a.tokenizer} tokenizer, {a.mode} fine-tuning on {a.task}: {a.steps} steps of {a.batch_size} "
          f"in {seconds:.0f} s with the gate (loss {figures['first_loss']:.3f} -> {figures['final_loss']:.3f})")
    g = figures["gate"]
    print(f"gate: answers right {g['answer_only_accuracy']:.3f}, valid traces {g['valid_rate']:.3f}, strategy gap {g['strategy_gap']:.3f}, "
          f"surprisal excess {g['surprisal_excess']:.3f}: {'passes' if g['passes'] else 'fails (' + '; '.join(g['failures']) + ')'}")
    if a.out: Path(a.out).write_text(json.dumps(figures, indent=1) + "\n")
    return figures


if __name__ == "__main__":
    main()
