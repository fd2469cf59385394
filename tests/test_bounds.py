"""Every numeric option has a ceiling, read from its row: a value beyond it, or a float that is not finite, is refused in one
line naming the option, on the command line and through the API, before anything is allocated or written."""
import math

import pytest

from basedirected.config import OPTIONS, build_parser, check_option_value, option_ceiling, resolve_config

NUMERIC = [o for o in OPTIONS if option_ceiling(o) is not None]
HUGE = ["2147483648", "9223372036854775808", "100000000000000000000", "1e300", "inf", "-inf", "nan"]


def test_every_numeric_option_has_a_ceiling():
    assert len(NUMERIC) >= 50 and all(option_ceiling(o).value < 2**31 and option_ceiling(o).why for o in NUMERIC)


@pytest.mark.parametrize("option", NUMERIC, ids=[o.flag for o in NUMERIC])
def test_a_value_beyond_an_options_ceiling_is_one_line_naming_it(option, capsys):
    for value in HUGE:
        with pytest.raises(SystemExit) as e: build_parser().parse_args([option.flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and option.flag in err[0], (value, err)
    ceiling = option_ceiling(option).value
    within = type(ceiling)(ceiling) if isinstance(ceiling, int) else ceiling
    assert check_option_value(option, within) == within  # the ceiling itself is allowed


@pytest.mark.parametrize("path, value", [("base.model.d_model", 2**31), ("c_samples", 2**31), ("train.steps", 10**20), ("train.free_bits", 1e300),
                                         ("metrics.n_routed", 2**63), ("cvae.code_init_noise", math.nan), ("train.weight_decay", math.inf)])
def test_the_api_meets_the_same_ceiling(path, value):
    with pytest.raises(ValueError, match=path.rsplit(".", 1)[-1]): resolve_config("sorting", "theta", {path: value})


def test_weight_decay_and_the_learning_rate_together_stay_below_one():
    with pytest.raises(ValueError, match=r"train.lr \* train.weight_decay must be < 1"): resolve_config("sorting", "theta", {"train.lr": 10.0, "train.weight_decay": 0.5})
    assert resolve_config("sorting", "theta", {"train.weight_decay": 0.1}).train.weight_decay == 0.1


@pytest.mark.parametrize("argv, message", [(["--no-metrics", "--n-routed", "5"], "--n-routed size the metrics: with --no-metrics they have no effect"),
                                           (["--no-metrics", "--n-routed", "5", "--n-forced", "3"], "--n-routed and --n-forced size the metrics"),
                                           (["--latent-dim", "8"], "--latent-dim has no effect here"),
                                           (["--beta-warmup-steps", "10", "--beta", "0.1"], "--beta-warmup-steps has no effect here (only the linear schedules ramp)"),
                                           (["--beta-zero-steps", "10", "--beta-schedule", "linear", "--beta", "0.1"], "--beta-zero-steps has no effect here")])
def test_an_option_without_effect_is_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    from basedirected.cli import train_main
    with pytest.raises(SystemExit) as e: train_main(["--run-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [(["--batch-size", "500", "--n-train", "300"], "--batch-size 500 exceeds the 300 training examples")])
def test_a_value_the_run_would_cap_is_refused_not_recorded(argv, message):
    from basedirected.config import config_from_args
    with pytest.raises(ValueError, match=message): config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("budgets", [[math.nan], [math.inf], [1.0, -1.0], []])
def test_a_device_budget_must_be_finite_and_positive(budgets):
    from basedirected.experiments import DevicePlacer
    with pytest.raises(ValueError, match="finite positive memory budget"): DevicePlacer(budgets)


API_REFUSALS = [
    ({"train.steps": "100"}, "train.steps must be an integer"), ({"train.steps": None}, "train.steps must be given a value"),
    ({"train.steps": 2.5}, "train.steps must be an integer"), ({"base.lr": math.inf}, "base.lr must be finite"),
    ({"base.lr": 1e3}, "base.lr must be <= 10"), ({"base.weight_decay": math.nan}, "base.weight_decay must be finite"),
    ({"base.weight_decay": -1.0}, "base.weight_decay must be >= 0"), ({"base.lr": 0.5, "base.weight_decay": 4.0}, "base.lr * base.weight_decay must be < 1"),
    ({"base.input_overrides": [1, 2]}, "input_overrides must map the task's field names"), ({"base.input_overrides": 5}, "input_overrides must map"),
    ({"base.input_overrides": {3: 1}}, "input_overrides must map"), ({"base.steps": 2.0}, "base.steps must be an integer"),
    ({"base.null_block_fraction": math.nan}, "base.null_block_fraction must be finite"), ({"cvae.K": 10**6}, "cvae.K must be <= 64"),
]


@pytest.mark.parametrize("overrides, message", API_REFUSALS, ids=[next(iter(o)) + "=" + repr(v)[:12] for o, _ in API_REFUSALS for v in [next(iter(o.values()))]])
def test_the_api_refuses_what_no_option_could_give_by_name(overrides, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")): resolve_config("sorting", overrides=overrides)


@pytest.mark.parametrize("overrides", [[("train.steps", 5)], "train.steps=5", {5: 1}])
def test_overrides_that_are_not_a_dict_of_paths_are_refused(overrides):
    with pytest.raises(ValueError, match="overrides must be a dict of dotted configuration paths"): resolve_config("sorting", overrides=overrides)
    with pytest.raises(ValueError, match="overrides must be a dict of dotted configuration paths"): resolve_config("sorting", backbone="/m", overrides=overrides)


def test_a_record_cannot_ask_for_more_codes_than_an_option_could():
    from basedirected.config import HFRunConfig, RunConfig
    from basedirected.cvae import CVAEConfig
    for k in (65, 10**6, 2**31):
        with pytest.raises(ValueError, match="K must be <= 64"): CVAEConfig(K=k)
    record = HFRunConfig("m", "d").to_dict(); record["cvae"]["K"] = 10**6  # an HF record edited to a million codes: refused before export builds it
    with pytest.raises(ValueError, match="K must be <= 64"): HFRunConfig.from_dict(record)
    record = RunConfig().to_dict(); record["cvae"]["K"] = 10**6
    with pytest.raises(ValueError, match="K must be <= 64"): RunConfig.from_dict(record)
