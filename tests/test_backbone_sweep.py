"""A preset on a Hugging Face backbone: every cell adapts from a base fine-tuned from the backbone on its task, one base per base seed shared
by its cells; a second sitting trains nothing; the records meet the reports; `basedirected-repro --backbone` refuses what a backbone cannot run."""
import pytest
import torch

from basedirected.backbone import save_tiny_backbone, task_records
from basedirected.collection import SweepDir
from basedirected.config import build_parser, hf_config_from_args
from basedirected.experiments import execute
from basedirected.presets import PRESETS, Preset, plan, with_backbone
from basedirected.reports import headline_text, read_results, write_reports
from basedirected.repro import repro_main, sweep_plan, sweep_plan_text
from basedirected.runs import RunDir, read_json
from basedirected.tasks import make_task

TINY = Preset("backbone-smoke", ("dist", "celbo"), "a test's miniature on a backbone", betas=(0.1,), seeds=(0, 1), base_seed=0, regimes=("sorting",),
              n_train=64, n_eval=16, base_steps=8, cvae_steps=4, evals=2, batch_size=8, c_samples=16, n_routed=8, n_forced=8,
              gate_exceptions=(("sorting", "an 8-step fine-tuning of a tiny backbone: the test checks the machinery, not the method"),))


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    n = torch.get_num_threads(); torch.set_num_threads(1)  # tiny models: threads only contend
    d = tmp_path_factory.mktemp("backbone") / "gpt2"
    task = make_task("sorting")
    save_tiny_backbone(d, [r.prompt + " " + r.response for r in task_records(task, task.generate(100, 0))], "gpt2")
    yield d
    torch.set_num_threads(n)


def test_a_preset_on_a_backbone_shares_one_fine_tuned_base_per_base_seed_and_its_records_meet_the_reports(backbone, tmp_path):
    preset = with_backbone(TINY, backbone)
    specs = plan(preset)
    assert len(specs) == 4 and all(s.key.endswith(("-gpt2-s0", "-gpt2-s1")) for s in specs) and {s.shared_base for s in specs} == {("sorting-gpt2", 0)}
    assert all(hf_config_from_args(build_parser().parse_args(list(s.argv))) == s.config for s in specs)  # each cell's command is its configuration
    assert "no time estimate" in sweep_plan_text(sweep_plan(tmp_path, preset), preset.name)
    records = execute(tmp_path, preset, jobs=1, device="cpu", progress=False)
    assert sorted(r["key"] for r in records) == sorted(s.key for s in specs)
    shared = RunDir(SweepDir(tmp_path).base("sorting-gpt2", 0))
    weights = read_json(shared.fine_tuned / "fine_tune.json")["sha256"]
    for s in specs:  # every cell adapted from the one fine-tuned base, nothing fine-tuned again
        rd = SweepDir(tmp_path).run(s.key)
        assert read_json(rd.fine_tuned / "fine_tune.json")["sha256"] == weights and not rd.base_checkpoint.exists()
    assert {(r["base_name"], r["base_seed"]) for r in records} == {("gpt2 fine-tuned", 0)} and all(r["settled"] in (True, False) for r in records)
    written = {s.key: SweepDir(tmp_path).run(s.key).metrics.stat().st_mtime_ns for s in specs}
    again = execute(tmp_path, preset, jobs=1, device="cpu", progress=False)  # a second sitting: every cell finished, nothing trains
    assert [r["key"] for r in again] == [r["key"] for r in records] and {s.key: SweepDir(tmp_path).run(s.key).metrics.stat().st_mtime_ns for s in specs} == written
    write_reports(tmp_path, records, {"preset": preset.name})
    rows = read_results(tmp_path)
    assert len(rows) == 4 and (tmp_path / "figures" / "answer.png").is_file() and headline_text(records).startswith("Headline:")


def test_the_command_refuses_what_a_backbone_cannot_run(backbone, tmp_path, capsys):
    for argv, says in ((["--preset", "quick"], "tau needs the break-even beta*"), (["--preset", "smoke"], "model and base_strategy_draws size the small transformer"),
                       (["--preset", "rescaling-one-seed", "--backbone", str(tmp_path / "none")], "is not a directory holding a saved model")):
        with pytest.raises(SystemExit) as e: repro_main([*argv, *(["--backbone", str(backbone)] if "--backbone" not in argv else []), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists()
    assert PRESETS["rescaling-one-seed"].backbone is None  # the presets themselves are the small transformer's
    # a preset sized for a language model needs one: without --backbone it is refused, naming the option
    with pytest.raises(SystemExit) as e: repro_main(["--preset", "paper-lm", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "sized for a language model" in err[0] and "--backbone DIR" in err[0], err
    assert not (tmp_path / "out").exists()
