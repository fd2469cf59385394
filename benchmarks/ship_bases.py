"""How the catalogue of shipped bases (basedirected/bases) was made: the bases the reference collections adapted from, then bases trained
for it from their recipes on this machine (each through a sweep's own preparation of a shared base: model, c_theta, gate).

    python benchmarks/ship_bases.py references          # the four bases of reference/meaning and reference/settled-2
    python benchmarks/ship_bases.py train NAME ...       # train and add the named bases of TRAINED below (resumes where it was killed)

A base joins the catalogue once; a name already listed is skipped. Run from a clean worktree: the catalogue records the revision."""
import sys
from pathlib import Path

from basedirected.experiments import prepare_shared_base

from basedirected.presets import PRESETS, plan
from basedirected.pretrained import add_to_catalogue, catalogue
from basedirected.machine import cpu_model, environment_record

ROOT = Path(__file__).resolve().parents[1]
AMD = "AMD EPYC (2-core x86_64), OMP_NUM_THREADS=1"
REFERENCES = {  # name -> (directory, revision it was trained at, what adapts from it)
    "sorting-s0": ("reference/meaning/bases/sorting-s0", "fed729b", "the default run; sorting's cells of every preset (meaning, study, followup, settled)"),
    "grid_pathfinding-s2": ("reference/meaning/bases/grid_pathfinding-s2", "fed729b", "grid pathfinding's cells of meaning, reader, shortcut, followup and settled (its first gated candidate)"),
    "addition-s0": ("reference/meaning/bases/addition-s0", "fed729b", "addition's cells of meaning, baseline, addition and settled"),
    "addition-s1": ("reference/settled-2/bases/addition-s1", "67af351", "addition's second base in settled (reference/settled-2)"),
}
TRAINED = {  # name -> (preset, regime, data seed, what adapts from it)
    "visiting_order-early-s0": ("quick", "early", 0, "the quick preset (1,500 steps on one draw per input: it fails the gate, as the preset says)"),
    "sorting-s1": ("settled", "sorting", 1, "settled's second sorting base"),
    "sorting-s2": ("settled", "sorting", 2, "settled's third sorting base"),
    "grid_pathfinding-s5": ("settled", "grid_pathfinding", 5, "a grid pathfinding candidate of settled and meaning"),
    "grid_pathfinding-s6": ("settled", "grid_pathfinding", 6, "a grid pathfinding candidate of settled and meaning"),
}


def references():
    for name, (d, revision, about) in REFERENCES.items():
        if name in catalogue(): continue
        add_to_catalogue(ROOT / d, name, about, {"cpu": AMD, "threads": 1, "flush_subnormals": False, "revision": revision, "first_served": d.rsplit("/bases/", 1)[0]})
        print("added", name)


def _spec(name):
    preset, regime, seed, _ = TRAINED[name]
    return next(s for s in plan(PRESETS[preset]) if s.regime == regime and s.config.data_seed == seed)


def _prepare(name):  # in a worker process: the sweep's own preparation of a shared base, trained here
    return prepare_shared_base(ROOT / "runs" / "ship-bases", _spec(name), "cpu", base_from="train")


def train(names, jobs=2):
    "Train the named bases (two at a time, one thread each, as a sweep's workers), then add them to the catalogue one by one."
    from concurrent.futures import ProcessPoolExecutor
    env, todo = environment_record(0), [n for n in names if n not in catalogue()]
    with ProcessPoolExecutor(jobs) as pool: gates = dict(zip(todo, pool.map(_prepare, todo)))
    for name in todo:
        spec, (preset, regime, seed, about) = _spec(name), TRAINED[name]
        made = {"cpu": cpu_model(), "threads": spec.config.threads, "flush_subnormals": spec.config.flush_subnormals,
                "revision": env["git_revision"][:7] + ("-dirty" if env["git_dirty"] else ""), "first_served": f"the {preset} preset"}
        add_to_catalogue(ROOT / "runs" / "ship-bases" / "bases" / f"{regime}-s{seed}", name, about, made)
        print("added", name, "passes the gate" if gates[name]["passes"] else "fails the gate")


if __name__ == "__main__":
    {"references": lambda a: references(), "train": train}[sys.argv[1]](sys.argv[2:])
