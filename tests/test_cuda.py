"""The GPU path: every latent and posterior trains under bf16 autocast on CUDA, the metrics, the gate and generation run there,
a GPU run agrees with the CPU run of the same configuration, and a training step reads the device once.

Selected with `pytest -m cuda` on a GPU machine; skipped, saying why, where there is no CUDA device. The CPU half of the
bf16 story (autocast dtypes end to end) is tested in test_train.py without a GPU.
"""
import math
import shutil
import warnings

import pytest
import torch

from basedirected.metrics import evaluate_model
from basedirected.runs import load_run, prepare_run, read_log
from basedirected.config import build_parser, config_from_args
from basedirected.train import run, train_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: run `pytest -m cuda` on a GPU machine")]

SMALL = ["--task", "visiting_order", "--posterior", "amortized", "--n-train", "512", "--n-eval", "64", "--base-steps", "200", "--c-samples", "64", "--steps", "30", "--batch-size", "16",
         "--eval-every", "15", "--checkpoint-every", "15"]
ARMS = [("discrete", "amortized"), ("discrete", "exact"), ("discrete", "exact+distill"), ("continuous", "amortized")]
# bf16 autocast against float32: measured differences are printed; these bounds say what "agree" means
STEP_RTOL, STEP_ATOL, FINAL_RTOL = 0.05, 0.01, 0.10


def config(*extra):
    return config_from_args(build_parser().parse_args([*SMALL, *extra]))


def arm_args(latent, posterior):
    return ["--latent", latent] + (["--posterior", posterior] if latent == "discrete" else [])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    "One base and c_theta, made on the CPU and shared by every run: GPU and CPU runs then differ only in the CVAE's device."
    d = tmp_path_factory.mktemp("base")
    prepare_run(d, config(), device="cpu")
    return d


def seeded(d, base_dir):
    d.mkdir(parents=True, exist_ok=True)
    for name in ("base.pt", "reference_scale.json"): shutil.copy(base_dir / name, d / name)
    return d


@pytest.mark.parametrize("latent,posterior", ARMS)
def test_every_arm_trains_measures_and_generates_on_cuda(base_dir, tmp_path, latent, posterior):
    cfg = config(*arm_args(latent, posterior))
    d = seeded(tmp_path / "run", base_dir)
    final = run(d, cfg, device="cuda")
    assert all(math.isfinite(v) for v in final.values() if isinstance(v, float)), final
    log = read_log(d / "log.jsonl")
    assert [r["step"] for r in log if r["split"] == "train"] == list(range(1, 31)) and not any("skipped" in r for r in log)
    r = load_run(d, "cuda")
    assert {p.device.type for p in r.model.parameters()} == {"cuda"}
    m = evaluate_model(r.model, r.held_out, r.eval_cache, r.task, n_routed=16, n_forced=8, seed=0, c_ref=r.c_ref, loss=cfg.loss,
                       beta=r.kl_weight(cfg.train.steps), reference=r.reference)
    for k in ("rate", "marginal_nll", "drift", "gain_z", "I_zxy"): assert math.isfinite(m[k]), (k, m[k])
    if latent == "discrete":
        assert 0 <= m["alignment_posterior"] <= 1 and any(k.startswith("gen_") for k in m)
    g = r.gate  # samples from the base on the GPU
    assert 0 <= g["answer_accuracy"] <= 1 and math.isfinite(g["surprisal_per_token"])


@pytest.mark.parametrize("latent,posterior", [("discrete", "exact"), ("continuous", "amortized")])
def test_gpu_run_agrees_with_cpu_run(base_dir, tmp_path, latent, posterior):
    cfg = config(*arm_args(latent, posterior))
    logs = {}
    for dev in ("cpu", "cuda"):
        d = seeded(tmp_path / dev, base_dir)
        run(d, cfg, device=dev)
        logs[dev] = read_log(d / "log.jsonl")
    first = {dev: next(r for r in log if r["split"] == "train") for dev, log in logs.items()}
    last = {dev: [r for r in log if r["split"] == "eval"][-1] for dev, log in logs.items()}
    keys = ["loss", "kl", "std", "theta"]
    print({k: (first["cpu"][k], first["cuda"][k]) for k in keys}, {k: (last["cpu"][k], last["cuda"][k]) for k in ("loss", "kl")})
    for k in keys: assert first["cuda"][k] == pytest.approx(first["cpu"][k], rel=STEP_RTOL, abs=STEP_ATOL), k
    assert last["cuda"]["loss"] == pytest.approx(last["cpu"]["loss"], rel=FINAL_RTOL)


@pytest.mark.parametrize("latent,posterior", [("discrete", "exact"), ("discrete", "amortized"), ("continuous", "amortized")])
def test_a_training_step_reads_the_device_once(base_dir, tmp_path, latent, posterior):
    r = prepare_run(seeded(tmp_path / "run", base_dir), config(*arm_args(latent, posterior)), device="cuda")
    opt = torch.optim.AdamW(r.model.parameters(), lr=1e-3)
    train_step(r, [opt], 0, 0.1, 1e-3)  # the caches and lazy CUDA state are built outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 5): train_step(r, [opt], step, 0.1, 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"{latent}/{posterior}: {len(syncs) / 4:.1f} host synchronizations per step", sorted({s[:100] for s in syncs}))
    assert len(syncs) <= 4, syncs


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
@pytest.mark.parametrize("latent,posterior", [("discrete", "exact"), ("discrete", "amortized"), ("continuous", "amortized")])
def test_a_group_on_cuda_matches_its_runs_alone_on_cuda(base_dir, tmp_path, latent, posterior, precision):
    "Three runs (two objectives, three betas, one of them 0) trained as one vmapped group on the GPU (bf16 with float32 masters, or TF32), and each alone there."
    from basedirected.groups import train_group
    from basedirected.train import train_run
    cells = [("theta", "0.1"), ("celbo", "0.0"), ("celbo_scaled", "0.3")]
    cfgs = [config(*arm_args(latent, posterior), "--objective", o, "--beta", b) for o, b in cells]
    alone = [train_run(prepare_run(seeded(tmp_path / f"alone{i}", base_dir), c, device="cuda")) for i, c in enumerate(cfgs)]
    runs = [prepare_run(seeded(tmp_path / f"group{i}", base_dir), c, device="cuda") for i, c in enumerate(cfgs)]
    together = train_group(runs, precision=precision)
    assert all(p.dtype == torch.float32 for r in runs for p in r.model.parameters())
    for i, (a, g) in enumerate(zip(alone, together)):
        first = [next(r for r in read_log(tmp_path / f"{w}{i}" / "log.jsonl") if r["split"] == "train") for w in ("alone", "group")]
        print(cells[i], {k: (first[0][k], first[1][k]) for k in ("loss", "kl", "theta")}, (a["loss"], g["loss"]))
        for k in ("loss", "kl", "std", "theta"): assert first[1][k] == pytest.approx(first[0][k], rel=STEP_RTOL, abs=STEP_ATOL), k
        assert g["loss"] == pytest.approx(a["loss"], rel=FINAL_RTOL)
        assert (tmp_path / f"group{i}" / "eval.json").exists()


def test_a_group_step_reads_the_device_once_and_compiles(base_dir, tmp_path):
    from basedirected.groups import RunGroup
    cfgs = [config("--posterior", "exact", "--beta", str(b)) for b in (0.05, 0.1, 0.2, 0.4)]
    runs = [prepare_run(seeded(tmp_path / f"g{i}", base_dir), c, device="cuda") for i, c in enumerate(cfgs)]
    group = RunGroup(runs)
    group.step(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 5): group.step(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"group of 4: {len(syncs) / 4:.1f} host synchronizations per step", sorted({s[:100] for s in syncs}))
    assert len(syncs) <= 4, syncs


def test_a_compiled_group_step_matches_the_eager_one(base_dir, tmp_path):
    from basedirected.groups import RunGroup
    cfgs = [config("--posterior", "exact", "--beta", str(b)) for b in (0.05, 0.1, 0.2, 0.4)]
    compiled = RunGroup([prepare_run(seeded(tmp_path / f"c{i}", base_dir), c, device="cuda") for i, c in enumerate(cfgs)], compile=True)
    records = [compiled.step(s) for s in range(3)]
    eager = [RunGroup([prepare_run(seeded(tmp_path / f"e{i}", base_dir), c, device="cuda") for i, c in enumerate(cfgs)]).step(0)]
    assert all(math.isfinite(r["loss"]) for rs in records for r in rs)
    for a, b in zip(eager[0], records[0]): assert b["loss"] == pytest.approx(a["loss"], rel=STEP_RTOL, abs=STEP_ATOL)
