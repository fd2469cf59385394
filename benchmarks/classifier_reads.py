"""What the coupling term's classifier can read from a response: held-out accuracy of c_psi trained directly on a label.

For each task as the `meaning` preset builds it, the classifier with each reader (the bag of tokens the preset ran with,
and the order-reading one of the `reader` preset) trained on the true strategy, and the bag reader on addition's operand
digit counts (one feature a per-input relabelling could follow): `basedirected.cvae.response_readability`, 500 AdamW steps
of 64 on 2,000 examples, 1,000 held out. One CSV row per (task, reader, label), with a Wilson interval, the majority
class's share, and the CPU model and revision it was computed at (seeded: exact on the same kind of CPU):

    OMP_NUM_THREADS=1 python benchmarks/classifier_reads.py --out reference/meaning/classifier_reads.csv

Figures are printed and written, never asserted; page 13e reads them.
"""
import argparse
import csv
from pathlib import Path

import torch

import basedirected.addition, basedirected.grid_pathfinding, basedirected.sorting  # registers the tasks
from basedirected.addition import operands
from basedirected.cvae import response_readability
from basedirected.machine import cpu_model, environment_record
from basedirected.tasks import wilson_interval

TASKS = ("sorting", "grid_pathfinding", "addition")


def digit_counts(example) -> int:
    "Addition's operand digit counts as one of four classes (3 or 4 digits each)."
    a, b = operands(example.x)
    return 2 * (len(str(a)) - 3) + len(str(b)) - 3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cells = [(t, ordered, "strategy", None) for t in TASKS for ordered in (False, True)] + [("addition", False, "digit counts", digit_counts)]
    env, rows = environment_record(0), []
    for task, ordered, name, label in cells:
        r = response_readability(task, ordered, label=label)
        lo, hi = wilson_interval(round(r["accuracy"] * r["n"]), r["n"])
        rows.append({"task": task, "reader": "ordered" if ordered else "bag", "label": name, "accuracy": r["accuracy"], "accuracy_lo": lo,
                     "accuracy_hi": hi, "n": r["n"], "majority": r["majority"], "cpu": cpu_model(), "git_revision": env["git_revision"],
                     "git_dirty": env["git_dirty"]})
        print(f"{task:17s} {rows[-1]['reader']:8s} {name:13s} held-out accuracy {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] (n {r['n']}; majority class {r['majority']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0])); w.writeheader(); w.writerows(rows)


if __name__ == "__main__":
    main()
