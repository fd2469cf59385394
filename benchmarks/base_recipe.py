"""Train one task's base model under a recipe and print how it learns: the quality gate on held-out and on training inputs,
and the excess decomposition (mixture error and leak, nats per example) every `--every` steps of its schedule.

Every option of `basedirected-train` that shapes the base is accepted (`--task`, `--base-steps`, `--d-model`, `--n-layers`,
`--n-train`, `--base-override-fraction`, `--base-strategy-draws`, `--seed`, ...); the base trains on `base_training_examples`, as in a run. `--grammar` rewrites grid pathfinding's trace for a diagnosis: `cell` writes each visited cell
as one token (`3,2`) instead of a row and a column token, `cell+distance` adds the distance still to go after each cell.

    python benchmarks/base_recipe.py --task grid_pathfinding --base-steps 10000 --seed 1 --every 1000 --out grid.json

Figures are printed and written, never asserted: this is the instrument behind the recipe tables of the task notebooks.
"""
import argparse
import dataclasses
import json
import time

import torch

import basedirected.grid_pathfinding as gp
from basedirected.base import (FrozenReference, SurprisalCache, base_gate, base_training_examples, excess_decomposition, pretrain_base,
                               trace_log_probs)
from basedirected.runs import run_vocab
from basedirected.model import collate, response_nll
from basedirected.tasks import Example, make_splits
from basedirected.config import build_parser, config_from_args

GRAMMARS = ("rc", "cell", "cell+distance")


@dataclasses.dataclass(frozen=True)
class CellGrid(gp.GridPathfinding):
    "Grid pathfinding whose trace names each cell with one token (diagnosis only: not a registered task); render and check write through `trace`."
    with_distance: bool = False

    @property
    def tokens(self):
        return super().tokens + tuple(f"{r},{c}" for r in range(6) for c in range(6))

    def trace(self, x, moves):
        _, (r, c), (gr, gc) = gp._endpoints(x)
        togo = lambda r, c: (str(abs(gr - r) + abs(gc - c)),) if self.with_distance else ()
        steps = tuple(t for m, mr, mc in moves for t in (m, f"{mr},{mc}", *togo(mr, mc)))
        return (f"{r},{c}", *togo(r, c)) + steps + ("=", gp.answer(x))


@torch.no_grad()
def excess_by_move_reason(model, vocab, task, examples):
    """Grid pathfinding: the base's surprisal above the ideal z-free profile on every strategy's trace (teacher-forced),
    summed by why each move is the one its strategy takes (`move_reasons`); other tokens (cells, answer, `</y>`) are `other`.
    Nats per untied input, each input's traces weighted by the prior, and each reason's share of move tokens."""
    totals, counts, n = {}, {}, 0
    for e in examples:
        if gp.tied(task, e.x): continue
        n += 1
        prior = task.strategy_prior(e.x)
        traces = [Example(e.x, task.render(e.x, s), s) for s in range(len(task.strategies))]
        nll, mask = response_nll(model, collate(vocab, traces))
        for s, ex in enumerate(traces):
            reasons = iter(gp.move_reasons(e.x, task.strategies[s]))
            ideal = task.ideal_surprisal(ex) + [0.0]  # `</y>` is certain once the answer is written
            for t, tok in enumerate(ex.y + ("</y>",)):
                r = next(reasons) if tok in gp.MOVES else "other"
                totals[r] = totals.get(r, 0.0) + prior[s] * (nll[s, t].item() - ideal[t])
                if r != "other": counts[r] = counts.get(r, 0) + prior[s]
    moves = sum(counts.values())
    return {r: {"excess": totals[r] / n, "share_of_moves": counts[r] / moves if r in counts else None} for r in sorted(totals)}


def rounded(d): return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if k != "data_frequencies"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--every", type=int, default=0, help="measure the decomposition every this many steps (0: only at the end)")
    p.add_argument("--grammar", choices=GRAMMARS, default="rc", help="grid pathfinding only: how the trace writes a cell")
    p.add_argument("--gate-inputs", type=int, default=256, help="held-out (and training) inputs the gate samples")
    p.add_argument("--base-lr", type=float, default=None, help="peak learning rate of the base's one-cycle schedule (default: BaseTrainConfig's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the figures to this JSON file")
    p.add_argument("--save", default=None, help="write the trained base's weights to this file (torch.save of its state dict)")
    own, rest = p.parse_known_args(argv)
    if own.threads: torch.set_num_threads(own.threads)
    cfg = config_from_args(build_parser().parse_args(rest))
    if own.base_lr is not None: cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, lr=own.base_lr))
    if own.grammar != "rc":
        if not isinstance(cfg.task, gp.GridPathfinding): raise SystemExit(f"--grammar {own.grammar} applies to grid_pathfinding, not {cfg.task.name}")
        cfg = dataclasses.replace(cfg, task=CellGrid(**{f.name: getattr(cfg.task, f.name) for f in dataclasses.fields(cfg.task)},
                                                     with_distance=own.grammar == "cell+distance"))
    vocab = run_vocab(cfg)
    train, held = make_splits(cfg.task, cfg.n_train, cfg.n_eval, seed=cfg.seed)
    print("one response:", " ".join(held[0].y), flush=True)
    n = own.gate_inputs
    curve = []
    if own.every and cfg.task.deterministic:
        watch = held[:n]
        prior = torch.tensor([cfg.task.strategy_prior(e.x) for e in watch], dtype=torch.float64)
        def on_step(step, model):
            if step % own.every: return
            d = excess_decomposition(trace_log_probs(model, vocab, cfg.task, watch), prior)
            curve.append({"step": step, "mixture_error": d["mixture_error"], "leak": d["leak"]})
            print(f"step {step}: mixture error {d['mixture_error']:.4f}, leak {d['leak']:.4f} nats per example", flush=True)
    else:
        on_step = None
    t0 = time.time()
    base, losses = pretrain_base(vocab, base_training_examples(cfg.task, train, cfg.base, cfg.seed, held), cfg.base, seed=cfg.seed, on_step=on_step)
    seconds = time.time() - t0
    if own.save: torch.save(base.state_dict(), own.save)
    gates = {}
    for name, exs in (("held_out", held[:n]), ("train", train[:n])):
        cache = SurprisalCache(FrozenReference(base), vocab, exs)
        gates[name] = rounded(base_gate(base, vocab, cfg.task, exs, cache, n=n))
        print(name, gates[name], flush=True)
    figures = {"task": cfg.task.name, "grammar": own.grammar, "seed": cfg.seed, "base": cfg.base.to_dict(), "n_train": cfg.n_train,
               "train_seconds": round(seconds, 1), "final_loss": losses[-1], "curve": curve, "gate": gates}
    if isinstance(cfg.task, gp.GridPathfinding):
        figures["excess_by_move_reason"] = excess_by_move_reason(base, vocab, cfg.task, held[:n])
        for r, v in figures["excess_by_move_reason"].items():
            share = "" if v["share_of_moves"] is None else f" ({v['share_of_moves']:.1%} of moves)"
            print(f"excess on {r} tokens: {v['excess']:.4f} nats per input{share}", flush=True)
    if own.out:
        with open(own.out, "w") as f: json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()
