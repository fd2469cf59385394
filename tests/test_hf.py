"""Hugging Face backbones: layout alignment, JSONL data, inert start, the reference by disabled adapters, the adaptation modes, resume and two processes."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from basedirected.cli import hf_train_main, train_main
from basedirected.config import build_parser, hf_config_from_args
from basedirected.cli import export_main
from basedirected.backbone import EncodedPairs, HFReference, encode_examples, load_backbone, pairs_to_examples, read_pairs, save_tiny_backbone
from basedirected.hf import build_hf_cvae, export_run, hf_run, prepare_hf_run
from basedirected.runs import load_run
from basedirected.config import AdaptConfig
from basedirected.train import train_run
from basedirected.cvae import CVAEConfig
from basedirected.model import collate, layout_tokens, response_nll
from basedirected.runs import read_log
from basedirected.tasks import Vocab, export_jsonl
from basedirected.visiting_order import VisitingOrder


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)  # tiny models: threads only contend
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    task = VisitingOrder.early()
    train, held = task.generate(64, 0), task.generate(32, 1)
    export_jsonl(task, train, d / "train.jsonl"); export_jsonl(task, held, d / "eval.jsonl")
    corpus = [r.prompt + " " + r.response for r in read_pairs(d / "train.jsonl")]
    for arch in ("gpt2", "qwen2"): save_tiny_backbone(d / arch, corpus, arch, train_steps=100)
    return d, task, train


def _args(d, run, *extra):
    return ["--backbone", str(d / "gpt2"), "--data", str(d / "train.jsonl"), "--eval-data", str(d / "eval.jsonl"), "--run-dir", str(run),
            "--K", "4", "--steps", "6", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "1", "--c-samples", "64",
            "--eval-every", "3", "--device", "cpu", "--quiet", *extra]


def _train_losses(run):
    return [r["loss"] for r in read_log(run / "log.jsonl") if r["split"] == "train"]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_jsonl_round_trip_and_the_package_layout(data, arch):
    d, task, train = data
    base, vocab = load_backbone(d / arch)
    records = read_pairs(d / "train.jsonl")
    examples, names = pairs_to_examples(vocab, records)
    assert names == tuple(sorted(task.strategies))
    assert [(e.x, e.y) for e in examples] == [(tuple(map(str, e.x)), e.y) for e in train]  # the tokenizer splits as the task wrote
    assert [names[e.strategy] for e in examples] == [task.strategies[e.strategy] for e in train]
    for codes in (None, ["<z2>"] * len(train)):
        ours, package = encode_examples(vocab, examples, codes), collate(Vocab.for_task(task), train, codes)
        for f in ("attention_mask", "response_start", "response_len", "latent_position"): assert torch.equal(getattr(ours, f), getattr(package, f)), f
        own = {"<bos>": vocab.tokenizer.bos_token or "<bos>", "<eos>": vocab.tokenizer.eos_token or "<eos>"}  # the tokenizer's names where it has them
        expected = [own.get(t, t) for t in layout_tokens(train[3], None if codes is None else codes[3])]
        assert vocab.decode(ours.ids[3, :int(ours.attention_mask[3].sum())]) == expected


def test_read_pairs_names_the_bad_line(tmp_path):
    good = json.dumps({"prompt": "1 2", "response": "2 1"})
    for body, message in ((good + "\n{oops\n", "line 2: not valid JSON"), (good + "\n" + json.dumps({"prompt": "1"}), "line 2: 'response' must be a string"),
                          ("[1, 2]\n", "line 1: expected a JSON object"), ("\n\n", "no records"),
                          (json.dumps({"prompt": "1", "response": "2", "strategy": [1]}), "line 1: 'strategy'")):
        (tmp_path / "d.jsonl").write_text(body)
        with pytest.raises(ValueError, match=message): read_pairs(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="no such data file"): read_pairs(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_codes_start_inert(data, arch):
    d, _, _ = data
    base, vocab = load_backbone(d / arch)
    rows = EncodedPairs(vocab, pairs_to_examples(vocab, read_pairs(d / "train.jsonl"))[0]).select(torch.arange(32))
    b, mask = HFReference(base).response_surprisal(rows.gen)
    model = build_hf_cvae(base, vocab, CVAEConfig(K=4), AdaptConfig("lora"))
    gap = lambda out: (((out.nll_per_code - b[:, None]).abs() * mask[:, None]).sum((0, 2)) / mask.sum()).max().item()  # the worst code
    out = model(rows)
    assert gap(out) < 0.03  # nats per token, each code against the reference's b_t
    torch.testing.assert_close(out.r, torch.full_like(out.r, 0.25), atol=5e-3, rtol=0)
    torch.testing.assert_close(out.q, torch.full_like(out.q, 0.25))
    with torch.no_grad():  # a code embedding moved off <znull> is no longer inert: the check can fail
        w = model.generator.get_input_embeddings().weight
        w[model.code_ids[0]] = 3 * w[vocab.id("3")]
    assert gap(model(rows)) > 0.1


@pytest.mark.parametrize("mode", ["lora", "frozen"])
def test_reference_without_a_copy_equals_a_frozen_copy(data, tmp_path, mode):
    d, _, _ = data
    a = _args(d, tmp_path / "run", "--adapt", mode, "--lr", "3e-2")
    config = hf_config_from_args(build_parser().parse_args(a))
    run = prepare_hf_run(tmp_path / "run", config, "cpu")
    train_run(run)
    frozen, _ = load_backbone(d / "gpt2")
    batch = run.train_rows.select(torch.arange(16)).gen
    mine, mask = run.reference.response_surprisal(batch)
    copy, _ = HFReference(frozen).response_surprisal(batch)
    torch.testing.assert_close(mine, copy, atol=1e-6, rtol=0)
    if mode == "lora":  # the adapters did train: the pass with them on is not the base
        trained = response_nll(run.model.generator, batch)[0]
        assert ((trained - copy).abs() * mask).max() > 1e-3
    else:  # the code rows did train: the generator is not the freshly initialized one
        fresh = build_hf_cvae(*load_backbone(d / "gpt2"), config.cvae, config.adapt, config.seed)
        rows = lambda m: m.generator.get_input_embeddings().weight[m.code_ids]
        assert (rows(fresh) - rows(run.model)).abs().max() > 1e-3


def test_adaptation_modes_train_what_they_say(data, tmp_path):
    d, _, _ = data
    counts = {}
    for mode in ("frozen", "lora", "full"):
        config = hf_config_from_args(build_parser().parse_args(_args(d, tmp_path / mode, "--adapt", mode, "--optimizer", "muon")))
        run = prepare_hf_run(tmp_path / mode, config, "cpu")
        before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        train_run(run)
        changed = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
        counts[mode] = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        emb = run.model.generator.get_input_embeddings().weight
        others = torch.ones(len(emb), dtype=torch.bool); others[run.model.code_ids] = False
        name = next(n for n, p in run.model.named_parameters() if p is emb)
        if mode != "full":
            assert torch.equal(emb[others], before[name][others])  # only the code rows of the embeddings move
            assert not any("posterior." in n and "lora" not in n for n in changed)
        assert not torch.equal(emb[run.model.code_ids], before[name][run.model.code_ids])
        assert any("lora_" in n for n in changed) == (mode == "lora")
        assert (run.dir.path / "log.jsonl").exists()
    assert counts["frozen"] < counts["lora"] < counts["full"]


def test_cli_metrics_and_exact_resume(data, tmp_path):
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "whole", "--posterior", "exact")) == 0
    m = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    for k in ("rate", "I_zxy", "I_zs_norm", "marginal_nll", "base_nll", "drift", "gain_per_position", "code_perplexity"): assert k in m
    assert hf_train_main(_args(d, tmp_path / "cut", "--posterior", "exact", "--stop-after", "4")) == 0
    assert not (tmp_path / "cut" / "metrics.json").exists()
    assert hf_train_main(_args(d, tmp_path / "cut", "--posterior", "exact")) == 0
    assert _train_losses(tmp_path / "cut") == _train_losses(tmp_path / "whole")
    assert json.loads((tmp_path / "cut" / "eval.json").read_text()) == json.loads((tmp_path / "whole" / "eval.json").read_text())


def test_cli_refuses_bad_input(data, tmp_path, capsys):
    d, _, _ = data
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "1", "response": "2"}) + "\n{\n")
    for argv, message in ((_args(d, tmp_path / "r1")[:1] + [str(tmp_path / "nowhere")] + _args(d, tmp_path / "r1")[2:], "not a directory"),
                          (["--data", str(tmp_path / "bad.jsonl")], "line 2"), (["--K", "0"], "K must be an integer >= 1"), (["--batch-size", "100"], "fewer than the batch size")):
        if argv[0] != "--backbone": argv = _args(d, tmp_path / "r2") + argv
        with pytest.raises(SystemExit) as e: hf_train_main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "r2").exists()  # refused before anything was written
    hf_train_main(_args(d, tmp_path / "r3", "--steps", "2"))
    with pytest.raises(SystemExit): hf_train_main(_args(d, tmp_path / "r3", "--steps", "3"))
    assert "different configuration" in capsys.readouterr().err


def test_two_processes_follow_the_one_process_trajectory(data, tmp_path):
    d, _, _ = data
    extra = ("--c-source", "data", "--optimizer", "muon")
    assert hf_train_main(_args(d, tmp_path / "one", *extra)) == 0
    script = tmp_path / "entry.py"
    script.write_text("import sys\nfrom basedirected.cli import hf_train_main\nsys.exit(hf_train_main(sys.argv[1:]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]  # a free port, bound by the launcher
    p = subprocess.run(cmd + _args(d, tmp_path / "two", *extra, "--stop-after", "4"), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    two = read_log(tmp_path / "two" / "log.jsonl")
    assert [r["step"] for r in two if r["split"] == "train"] == [1, 2, 3, 4]  # one writer
    assert json.loads((tmp_path / "two" / "config.json").read_text())["environment"]["world_size"] == 2
    assert hf_train_main(_args(d, tmp_path / "two", *extra)) == 0  # resumed on one process
    # Muon orthogonalizes the update in bfloat16, so the all-reduce's summation order shows after a few steps (measured: 3e-5
    # relative at step 6 under the cosine schedule); a wrong shard of the global batch moves the loss by far more
    torch.testing.assert_close(torch.tensor(_train_losses(tmp_path / "two")), torch.tensor(_train_losses(tmp_path / "one")), rtol=1e-4, atol=1e-6)


def test_basedirected_train_trains_a_backbone_run_and_load_run_opens_it(data, tmp_path):
    d, _, _ = data
    assert train_main(_args(d, tmp_path / "via-train", "--steps", "2")) == 0
    assert [r["step"] for r in read_log(tmp_path / "via-train" / "log.jsonl") if r["split"] == "train"] == [1, 2]
    run = load_run(tmp_path / "via-train")  # one loader for every backbone: the run's config.json names its own
    ck = torch.load(tmp_path / "via-train" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 2 and set(ck) == {"model", "optimizer", "step", "config", "c_ref"} and isinstance(ck["optimizer"], list)
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in ck["model"].items())


def test_the_checker_reads_exported_records_back(data):
    "The data's own responses, tokenized by the model's tokenizer and read back, pass the task's checker with the right answer."
    from basedirected.backbone import load_backbone, task_input, task_response
    d, task, train = data
    _, vocab = load_backbone(d / "gpt2")
    records = read_pairs(d / "train.jsonl")
    checks = [task.check(task_input(r.prompt), task_response(vocab, vocab.tokenize(r.response))) for r in records]
    assert all(c.valid and c.answer_correct for c in checks)
    assert [task.strategies[c.strategy] for c in checks if c.strategy >= 0] == [r.strategy for r, c in zip(records, checks) if c.strategy >= 0]


def test_task_metrics_on_a_backbone(data, tmp_path):
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "task", "--posterior", "exact", "--task", "visiting_order")) == 0
    m = json.loads((tmp_path / "task" / "metrics.json").read_text())
    for k in ("valid_rate", "answer_rate", "alignment_controlled", "forced_answer_rate", "coverage_mean", "coverage_full_rate"):
        assert 0 <= m[f"gen_{k}"] <= 1, k
    with pytest.raises(SystemExit): hf_train_main(_args(d, tmp_path / "bad", "--regime", "early"))  # a regime needs a task


def _refused(argv, capsys):
    "Exit status and last stderr line of a refused hf_train_main."
    with pytest.raises(SystemExit) as e: hf_train_main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_backbone_without_tokenizer_files_weights_or_a_readable_config_is_refused_before_anything_is_written(data, tmp_path, capsys):
    d, _, _ = data
    cases = {"no-tokenizer": (lambda p: [f.unlink() for f in p.iterdir() if "token" in f.name or f.name == "vocab.json"], "its tokenizer"),
             "no-weights": (lambda p: [f.unlink() for f in p.glob("model.safetensors")], "holds no weights"),
             "broken-config": (lambda p: (p / "config.json").write_text("{ broken"), "its config.json cannot be read")}
    for name, (damage, message) in cases.items():
        shutil.copytree(d / "gpt2", tmp_path / name); damage(tmp_path / name)
        argv = _args(d, tmp_path / f"run-{name}"); argv[1] = str(tmp_path / name)
        code, line = _refused(argv, capsys)
        assert code == 2 and message in line and str(tmp_path / name) in line, line
        assert not (tmp_path / f"run-{name}").exists()


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_backbone_whose_weights_cannot_be_read_is_one_line(data, tmp_path, capsys, damage):
    "A damaged model.safetensors: transformers' own forty-line traceback becomes one line naming the backbone."
    d, _, _ = data
    shutil.copytree(d / "gpt2", tmp_path / "b")
    w = tmp_path / "b" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2] if damage == "cut" else b"\x00not weights" * 64)
    argv = _args(d, tmp_path / "run"); argv[1] = str(tmp_path / "b")
    code, line = _refused(argv, capsys)
    assert code == 2 and "cannot be loaded" in line and str(tmp_path / "b") in line, line


@pytest.mark.parametrize("extra, message", [
    (["--task", "visiting_order", "--regime", "bogus"], "--regime bogus is not a preset of task visiting_order"),
    (["--task", "sorting"], "are valid sorting traces; is the data exported from that task?"),
    (["--lora-targets", "c_attn,no_such_module"], "--lora-targets no_such_module: no such module in the backbone"),
    (["--stop-after", "-1"], "--stop-after must be >= 1, got -1"),
])
def test_hf_inputs_that_cannot_work_are_refused_before_anything_is_written(data, tmp_path, capsys, extra, message):
    d, _, _ = data
    code, line = _refused(_args(d, tmp_path / "run", *extra), capsys)
    assert code == 2 and message in line, line
    assert not (tmp_path / "run").exists()


def test_hf_long_prompts_bad_run_dirs_and_damaged_files_are_named(data, tmp_path, capsys):
    d, task, _ = data
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": " ".join(["1"] * 300), "response": "1"}) + "\n" + (d / "train.jsonl").read_text())
    argv = _args(d, tmp_path / "run"); argv[argv.index("--data") + 1] = str(long)
    code, line = _refused(argv, capsys)
    assert code == 2 and "training record 1: 310 tokens with the layout, over the backbone's context of 256" in line and not (tmp_path / "run").exists()
    bad = tmp_path / "bytes.jsonl"; bad.write_bytes(b'{"prompt": "1 2", "response": "\xff"}\n')
    argv = _args(d, tmp_path / "run"); argv[argv.index("--data") + 1] = str(bad)
    assert "bytes.jsonl line 1: not UTF-8 text (byte 0xff" in _refused(argv, capsys)[1]
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in _refused(_args(d, tmp_path / "f" / "run"), capsys)[1]
    run = tmp_path / "made"
    assert hf_train_main(_args(d, run, "--stop-after", "3", "--checkpoint-every", "3")) == 0
    ck = torch.load(run / "checkpoint.pt", weights_only=True)
    name = next(k for k, t in ck["model"].items() if t.is_floating_point())
    bad = {**ck, "model": {**ck["model"], name: torch.full_like(ck["model"][name], float("nan"))}}; torch.save(bad, run / "checkpoint.pt")
    assert "checkpoint.pt holds non-finite weights" in _refused(_args(d, run, "--checkpoint-every", "3"), capsys)[1]
    del ck["step"]; torch.save(ck, run / "checkpoint.pt")
    assert "checkpoint.pt lacks step" in _refused(_args(d, run, "--checkpoint-every", "3"), capsys)[1]
    (run / "checkpoint.pt").unlink(); (run / "log.jsonl").unlink()
    (run / "reference_scale.json").write_text('{"world_size": 1}')
    assert "reference_scale.json lacks the c_theta estimates" in _refused(_args(d, run, "--checkpoint-every", "3"), capsys)[1]


def test_hf_force_leaves_a_directory_whose_config_json_is_not_a_run_alone(data, tmp_path, capsys):
    d, _, _ = data
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    code, line = _refused(_args(d, tmp_path, "--force"), capsys)
    assert code == 2 and "is not a run directory" in line and (tmp_path / "config.json").read_text() == '{"lr": 0.1}'


def test_hf_a_torn_final_eval_record_is_written_again_and_a_rerun_clears_temporaries(data, tmp_path):
    d, _, _ = data
    run = tmp_path / "run"
    assert hf_train_main(_args(d, run)) == 0
    lines = (run / "log.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["split"] == "eval" and json.loads(lines[-1])["step"] == 6
    (run / "log.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    (run / ".checkpoint.pt.tmp4242").write_bytes(b"half")
    assert hf_train_main(_args(d, run)) == 0
    assert read_log(run / "log.jsonl") == [json.loads(l) for l in lines] and not (run / ".checkpoint.pt.tmp4242").exists()


def test_hf_k1_needs_allow_inert_as_basedirected_train_does(data, tmp_path, capsys):
    d, _, _ = data
    code, line = _refused(_args(d, tmp_path / "run", "--K", "1"), capsys)
    assert code == 2 and "--K 1 leaves a discrete latent inert by construction" in line and "--allow-inert" in line
    assert not (tmp_path / "run").exists()
    assert hf_train_main(_args(d, tmp_path / "run", "--K", "1", "--allow-inert", "--steps", "2")) == 0


def test_hf_resume_compares_the_checkpoints_configuration_when_config_json_is_lost(data, tmp_path, capsys):
    "A rerun with another --lr after config.json is lost is refused by the checkpoint's own record, not continued silently."
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "run", "--stop-after", "3", "--checkpoint-every", "3")) == 0
    (tmp_path / "run" / "config.json").unlink()
    code, line = _refused(_args(d, tmp_path / "run", "--lr", "1e-3", "--checkpoint-every", "3"), capsys)
    assert code == 2 and "checkpoint.pt was written by a run with another configuration" in line, line
    assert hf_train_main(_args(d, tmp_path / "run", "--checkpoint-every", "3")) == 0  # the same configuration resumes


def test_hf_a_run_interrupted_before_its_first_checkpoint_logs_each_evaluation_once(data, tmp_path):
    d, _, _ = data
    argv = _args(d, tmp_path / "run", "--checkpoint-every", "100")
    assert hf_train_main([*argv, "--stop-after", "4"]) == 0
    assert not (tmp_path / "run" / "checkpoint.pt").exists()  # stopped before its first checkpoint
    assert hf_train_main(argv) == 0
    assert [r["step"] for r in read_log(tmp_path / "run" / "log.jsonl") if r["split"] == "eval"] == [3, 6]


def test_hf_cached_and_recomputed_reference_agree(data, tmp_path):
    "--recompute-reference runs the frozen reference (adapters disabled) every step instead of the cache: the same b_t, so the same run."
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "cached", "--posterior", "exact")) == 0
    assert hf_train_main(_args(d, tmp_path / "recomputed", "--posterior", "exact", "--recompute-reference")) == 0
    torch.testing.assert_close(torch.tensor(_train_losses(tmp_path / "recomputed")), torch.tensor(_train_losses(tmp_path / "cached")), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda r: {**r, "response": ""}, "record 2: the response is empty"),
    (lambda r: {**r, "prompt": r["prompt"] + " <z1>"}, "record 2: the prompt contains '<z1>', a token of the CVAE's layout"),
    (lambda r: {**r, "response": r["response"] + " </y>"}, "record 2: the response contains '</y>'"),
    (lambda r: {**r, "response": r["response"] + " xylophone"}, "record 2: the tokenizer writes part of the response"),
])
def test_records_the_cvae_cannot_learn_from_are_refused_by_number_before_anything_is_written(data, tmp_path, capsys, change, message):
    d, _, _ = data
    lines = (d / "train.jsonl").read_text().splitlines()
    lines[1] = json.dumps(change(json.loads(lines[1])))
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    argv = _args(d, tmp_path / "run")
    argv[argv.index("--data") + 1] = str(tmp_path / "train.jsonl")
    with pytest.raises(SystemExit) as e: hf_train_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_hf_run_holds_its_run_directory(data, tmp_path):
    d, _, _ = data
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; from basedirected.runs import exclusive_run_dir\n"
                               f"with exclusive_run_dir({str(run_dir)!r}): print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        config = hf_config_from_args(build_parser().parse_args(_args(d, run_dir)))
        with pytest.raises(ValueError, match="another process is running in this run directory"): hf_run(run_dir, config, device="cpu")
        with pytest.raises(SystemExit) as e: hf_train_main(_args(d, run_dir))
        assert e.value.code == 2 and os.listdir(run_dir) == []
    finally: holder.kill(); holder.wait()


@pytest.mark.parametrize("arch, posterior", [("gpt2", "exact"), ("qwen2", "amortized")])  # tied and untied embeddings
def test_an_exported_run_loads_back_with_peft_and_gives_the_generators_logits(data, tmp_path, arch, posterior):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, _, _ = data
    argv = _args(d, tmp_path / "run", "--adapt", "lora", "--posterior", posterior, "--lr", "3e-2", "--no-metrics"); argv[1] = str(d / arch)
    assert hf_train_main(argv) == 0
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    run, out = load_run(tmp_path / "run"), tmp_path / "out"
    tok = AutoTokenizer.from_pretrained(out)
    assert all(tok.convert_tokens_to_ids(t) == run.vocab.id(t) for t in run.vocab.added)  # the layout's tokens and codes, same ids
    fresh = AutoModelForCausalLM.from_pretrained(d / arch); fresh.resize_token_embeddings(len(tok), mean_resizing=False)
    batch = encode_examples(run.vocab, run.held_out[:8], ["<z2>"] * 8)
    logits = lambda m: m(input_ids=batch.ids, attention_mask=batch.attention_mask.long()).logits
    with torch.no_grad():
        bare, mine = logits(fresh), logits(run.model.generator.model)
        loaded = PeftModel.from_pretrained(fresh, out)
        theirs = logits(loaded)
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-5)
    assert (bare - mine).abs().max() > 1e-2  # the adapter and code rows carry what trained: the check can fail
    if posterior == "amortized":  # a second adapter, on the same loaded model, with its head
        base = encode_examples(run.vocab, run.held_out[:8])
        hidden = lambda m: m(input_ids=base.ids, attention_mask=base.attention_mask.long(), output_hidden_states=True).hidden_states[-1]
        loaded.load_adapter(out / "posterior", adapter_name="posterior"); loaded.set_adapter("posterior")
        with torch.no_grad(): torch.testing.assert_close(hidden(loaded), hidden(run.model.posterior.model), atol=1e-5, rtol=1e-5)
        head = torch.load(out / "posterior" / "posterior_head.pt", weights_only=True)
        assert all(torch.equal(head[k], v) for k, v in run.model.posterior_head.state_dict().items())
    else: assert not (out / "posterior").exists()
    export_run(tmp_path / "run", tmp_path / "whole", whole_model=True)  # the LoRA merged into one model that transformers loads alone
    with torch.no_grad(): torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "whole")), mine, atol=1e-5, rtol=1e-5)


def test_export_refuses_what_it_cannot_export_in_one_line(data, tmp_path, capsys):
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "run", "--posterior", "exact", "--steps", "2", "--no-metrics")) == 0
    capsys.readouterr()
    def refused(run, out, message):
        with pytest.raises(SystemExit) as e: export_main([str(run), str(out)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and message in lines[0] and str(run if "exists" not in message else out) in lines[0], lines
    (tmp_path / "file").write_text("x"); (tmp_path / "busy").mkdir(); (tmp_path / "busy" / "f").write_text("x")
    refused(tmp_path / "run", tmp_path / "busy", "exists and is not empty")
    refused(tmp_path / "run", tmp_path / "file", "exists and is not empty")
    refused(tmp_path / "nowhere", tmp_path / "out", "is not a run directory")
    (tmp_path / "tiny").mkdir(); (tmp_path / "tiny" / "config.json").write_text(json.dumps({"config": {}, "environment": {}}))
    refused(tmp_path / "tiny", tmp_path / "out", "is not a run on a Hugging Face backbone")
    for mode in ("frozen", "full"):  # the refusal reads config.json only: a LoRA run relabelled stands in for one
        shutil.copytree(tmp_path / "run", tmp_path / mode)
        record = json.loads((tmp_path / mode / "config.json").read_text()); record["config"]["adapt"]["mode"] = mode
        (tmp_path / mode / "config.json").write_text(json.dumps(record))
        refused(tmp_path / mode, tmp_path / "out", f"adapt mode '{mode}' trains no adapter; pass --whole-model")
    (tmp_path / "run" / "checkpoint.pt").unlink()
    refused(tmp_path / "run", tmp_path / "out", "checkpoint.pt is missing")
    assert not (tmp_path / "out").exists()


def test_grad_accum_on_a_backbone_follows_the_whole_batch_trajectory(data, tmp_path, capsys):
    d, _, _ = data
    for n in ("1", "4"):
        assert hf_train_main(_args(d, tmp_path / n, "--posterior", "amortized", "--grad-clip", "1e6", "--grad-accum", n, "--no-metrics")) == 0
    torch.testing.assert_close(torch.tensor(_train_losses(tmp_path / "4")), torch.tensor(_train_losses(tmp_path / "1")), rtol=1e-5, atol=1e-6)
    from basedirected.config import HFRunConfig
    from basedirected.conventions import same_configuration
    written = json.loads((tmp_path / "1" / "config.json").read_text())["config"]
    older = {**written, "train": {k: v for k, v in written["train"].items() if k != "grad_accum"}}  # as written before the option existed
    assert same_configuration(older, written, HFRunConfig.from_dict(written))
    capsys.readouterr()
    code, line = _refused(_args(d, tmp_path / "bad", "--grad-accum", "3"), capsys)
    assert code == 2 and "--batch-size 8 must be divisible by --grad-accum 3" in line and not (tmp_path / "bad").exists()


def test_hf_train_help_lists_only_the_options_of_a_backbone(capsys):
    import re
    from basedirected.config import OPTIONS
    with pytest.raises(SystemExit) as e: hf_train_main(["--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0
    listed = {o.flag for o in OPTIONS if re.search(rf"\n  {re.escape(o.flag)}[ \n]", text)}
    assert listed == {o.flag for o in OPTIONS if "hf" in o.backbones} and {"--base-steps", "--tau"}.isdisjoint(listed)
    assert {"--n-train", "--fine-tune-steps", "--allow-failed-base"} <= listed  # the task's own data and the base fine-tuned on them
    assert "synthetic task" not in text.split("options:")[0] and "Hugging Face causal LM" in text.split("options:")[0]
    assert re.search(r"--c-samples C_SAMPLES\s+samples for c_theta \(default: 512\)", text)  # the backbone's default, not the small transformer's
    assert "--base-steps" in build_parser().format_help()  # basedirected-train still lists every option


def test_two_processes_with_grad_accum_follow_the_one_process_whole_batch_trajectory(data, tmp_path):
    d, _, _ = data
    extra = ("--c-source", "data", "--grad-clip", "1e6", "--no-metrics")
    assert hf_train_main(_args(d, tmp_path / "one", *extra)) == 0
    script = tmp_path / "entry.py"
    script.write_text("import sys\nfrom basedirected.cli import hf_train_main\nsys.exit(hf_train_main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    p = subprocess.run(cmd + _args(d, tmp_path / "two", *extra, "--grad-accum", "2"), env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # each process steps its 4 examples in 2 micro-batches and DDP reduces once: the one-process whole-batch trajectory
    torch.testing.assert_close(torch.tensor(_train_losses(tmp_path / "two")), torch.tensor(_train_losses(tmp_path / "one")), rtol=1e-5, atol=1e-6)


def test_export_writes_beside_out_and_refuses_in_one_line_what_it_cannot_write(data, tmp_path, capsys):
    "OUT below a file, OUT '', a run that has not finished, a full disk: one line each, and no half export left behind."
    import subprocess
    d, _, _ = data
    assert hf_train_main(_args(d, tmp_path / "run", "--posterior", "exact", "--steps", "2", "--no-metrics")) == 0
    capsys.readouterr()
    def refused(out, message, run=tmp_path / "run"):
        with pytest.raises(SystemExit) as e: export_main([str(run), str(out)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file" / "out", "is not a directory")
    refused("", "OUT must name a directory")
    shutil.copytree(tmp_path / "run", tmp_path / "live"); (tmp_path / "live" / "eval.json").unlink()  # a run still training has no eval.json
    refused(tmp_path / "out", "has not finished (no eval.json)", run=tmp_path / "live")
    small = tmp_path / "small"; small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(small)], capture_output=True).returncode: pytest.skip("cannot mount a small file system here")
    try:
        refused(small / "out", "No space left on device; nothing was exported")
        assert list(small.iterdir()) == []  # no partial export, and no temporary left
    finally: subprocess.run(["umount", str(small)])
    failed = []
    for size in ("16k", "48k", "96k", "160k"):  # full at another file: the weights (safetensors' own error), the tokenizer (tokenizers'), the card
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)], check=True)
        try:
            try: code = export_main([str(tmp_path / "run"), str(small / "out")])
            except SystemExit as e: code = e.code
            lines = capsys.readouterr().err.strip().splitlines()
            assert code in (0, 2) and len(lines) <= 1 and "Traceback" not in "\n".join(lines), (size, lines)
            if code == 2: assert "nothing was exported" in lines[0] and list(small.iterdir()) == [], (size, lines)
            failed.append(code == 2)
        finally: subprocess.run(["umount", str(small)])
    assert any(failed)  # the disk ran out at least once past the first file


def test_a_ctrl_c_while_export_imports_transformers_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib
    real = importlib.import_module
    def interrupted(name, *a, **k):
        if name == "basedirected.hf": raise KeyboardInterrupt
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as e: export_main([str(tmp_path / "run"), str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 130 and lines == ["basedirected-export: interrupted; nothing was exported"]


def test_a_lora_run_leaks_no_library_warning(data, tmp_path):
    "peft's warnings on GPT-2's Conv1D and transformers' deprecated name are known and harmless: a run shows neither."
    import warnings
    d, _, _ = data
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert hf_train_main(_args(d, tmp_path / "run", "--adapt", "lora", "--steps", "2", "--no-metrics")) == 0
    leaked = [str(w.message) for w in seen if "peft" in w.filename or "transformers" in w.filename]
    assert not leaked, leaked


def test_a_misspelt_shipped_model_is_one_line_naming_the_shipped_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as e: train_main(["--backbone", "austen-gtp2", "--task", "sorting", "--run-dir", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "'austen-gtp2' is not the name of a shipped language model (austen-gpt2)" in err[0], err
    assert not (tmp_path / "run").exists()
