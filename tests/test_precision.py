"""``training.precision``: one setting that every backend maps to its own mechanism, with the
strategies agreeing with each other within a tolerance derived from the effect of the precision
itself (docs/precision.md), model-state bytes that count what each backend holds, and a record
that says what was computed in. Two real ranks on gloo, real FSDP, DeepSpeed and Accelerate."""

import sys

import pytest

from analysis.records.load import load_runs
from analysis.report.derive import derive
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv
from strategies.step.precision_support import cpu_fp16_supported
from tests.helpers.launch import run_jobs
from tests.helpers.parity import STRATEGIES, experiment, max_rel_diff, single_losses
from tests.helpers.records import make_record, write_record

BF16 = ["ddp", "fsdp1", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3_offload", "accelerate"]
# fp16 under the strategies whose loss scaler follows torch.amp.GradScaler's schedule (DeepSpeed's
# is set to it); docs/precision.md says why stage 0 and Accelerate on CPUs are not among them.
FP16 = ["ddp", "fsdp1", "fsdp2", "zero2"]
GRID = {"grid_update_every": 4, "grid_update_until": 12}


def lacks(precision: str, strategy: str) -> str | None:
    """What this machine lacks to run ``precision`` under preset ``strategy`` (None: nothing)."""
    cfg = parse_experiment(experiment("bspline", STRATEGIES[strategy], 1, "runs"))
    return cfg.strategy.missing_precision_support(precision, "cpu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    refs = {
        p: single_losses(experiment("bspline", {"name": "single"}, 1, str(tmp / "s"), precision=p))
        for p in ("fp32", "bf16", "fp16")
    }
    refs["grid"] = single_losses(experiment("bspline", {"name": "single"}, 1, str(tmp / "s"), precision="bf16", **GRID))
    jobs = [
        {"id": f"bf16/{k}", "config": experiment("bspline", STRATEGIES[k], 1, str(tmp / "r"), precision="bf16")}
        for k in BF16
    ]
    jobs += [
        {"id": f"fp16/{k}", "config": experiment("bspline", STRATEGIES[k], 1, str(tmp / "r"), precision="fp16")}
        for k in FP16
        if lacks("fp16", k) is None
    ]
    jobs += [
        {"id": f"grid/{k}", "config": experiment("bspline", STRATEGIES[k], 2, str(tmp / "r"), precision="bf16", **GRID)}
        for k in ("ddp", "zero0", "zero3")
    ]
    return refs, run_jobs(jobs, tmp)


def tolerance(refs: dict, precision: str) -> float:
    """Half the distance between the low-precision and the fp32 one-process runs (docs/precision.md)."""
    effect = max_rel_diff(refs[precision], refs["fp32"])
    assert effect > 1e-3, f"{precision} barely changes this run ({effect:.1e}): the comparison would prove nothing"
    return effect / 2


@pytest.mark.parametrize("strategy", BF16)
def test_bf16_under_every_cpu_strategy_agrees_with_one_process_within_the_derived_tolerance(runs, strategy):
    refs, results = runs
    result = results[f"bf16/{strategy}"]
    assert result["status"] == "ok" and result["ranks_identical"]
    assert max_rel_diff(result["losses"], refs["bf16"]) < tolerance(refs, "bf16")
    assert result["precision"]["setting"] == "bf16" and result["precision"]["compute_dtype"] == "bfloat16"
    assert result["precision"]["optimizer_dtype"] == "float32"  # the weights the optimizer updates stay float32


@pytest.mark.parametrize("strategy", FP16)
def test_fp16_with_loss_scaling_agrees_within_the_derived_tolerance(runs, strategy):
    if lack := lacks("fp16", strategy):
        pytest.skip(f"fp16 under {strategy} cannot run on this CPU: {lack}")
    refs, results = runs
    result = results[f"fp16/{strategy}"]
    assert result["status"] == "ok" and result["precision"]["compute_dtype"] == "float16"
    assert max_rel_diff(result["losses"], refs["fp16"]) < tolerance(refs, "fp16")


@pytest.mark.parametrize("strategy", ["ddp", "zero0", "zero3"])
def test_grid_updates_under_bf16_refit_the_float32_weights(runs, strategy):
    refs, results = runs
    result = results[f"grid/{strategy}"]
    assert result["status"] == "ok" and result["ranks_identical"]
    assert max_rel_diff(result["losses"], refs["grid"]) < tolerance(refs, "bf16")


def test_model_state_counts_what_each_backend_holds_master_copies_included(runs):
    _, results = runs
    state = {k: results[f"bf16/{k}"]["model_state"] for k in ("ddp", "fsdp2", "zero0", "zero1", "zero3")}
    full = state["ddp"]["params"]  # float32 parameters, whole, under autocast: no other copy
    assert state["ddp"]["master_params"] == 0 and state["fsdp2"]["params"] == full // 2  # sharded float32 masters
    # DeepSpeed holds the module in bf16 (2 of 4 bytes) and float32 masters: whole at stage 0, sharded from stage 1
    assert state["zero0"]["params"] == full // 2 and state["zero0"]["master_params"] == full
    assert state["zero1"]["params"] == full // 2 and state["zero1"]["master_params"] == full // 2
    assert state["zero3"]["params"] == full // 4 and state["zero3"]["master_params"] == full // 2
    assert "DeepSpeed bf16" in results["bf16/zero0"]["precision"]["mechanism"]
    assert results["bf16/zero0"]["precision"]["param_dtype"] == "bfloat16"
    assert "MixedPrecisionPolicy(param_dtype=bfloat16" in results["bf16/fsdp2"]["precision"]["mechanism"]


def test_the_record_says_what_was_computed_in_even_where_autocast_does_not_reach(tmp_path):
    """pykan's layers compute with operations autocast leaves in float32: asked for bf16, the record
    says so instead of claiming bf16."""
    cfg = experiment("pykan", {"name": "single"}, 1, str(tmp_path), precision="bf16")
    record = Trainer(
        parse_experiment({**cfg, "training": {**cfg["training"], "steps": 3}}), DistEnv(), show_progress=False
    ).run()
    assert record.precision.setting == "bf16" and record.precision.compute_dtype == "float32"
    assert record.precision.mechanism == "torch.autocast(bfloat16)"


@pytest.mark.parametrize(
    "training,strategy,message",
    [
        (
            {"precision": "bf16", "dtype": "float64"},
            {"name": "single"},
            "training: precision bf16 keeps float32 master weights, but dtype is float64",
        ),
        (
            {"precision": "fp32"},
            {"name": "fsdp2", "param_dtype": "bfloat16"},
            "strategy.param_dtype: bfloat16 contradicts training.precision=fp32",
        ),
        (
            {"precision": "fp16"},
            {"name": "accelerate", "config_file": "configs/accelerate/ddp_cpu.yaml"},
            "Accelerate does not autocast fp16 on CPUs",
        ),
    ],
)
def test_precisions_a_backend_cannot_run_are_refused_before_launch(training, strategy, message):
    from strategies.lifecycle.preflight import preflight

    cfg = experiment("bspline", strategy, 1, "runs")
    try:
        parsed = parse_experiment({**cfg, "training": {**cfg["training"], **training}})
        preflight(parsed, "cpu", 2)
    except ConfigError as err:
        assert message in str(err).replace("\n", " ")
    else:
        pytest.fail("not refused")


@pytest.fixture
def no_cpu_fp16(monkeypatch):
    """This CPU taken for one without oneDNN fp16 kernels (AMD EPYC, Intel before Sapphire Rapids),
    so the refusal is exercised on every machine."""
    monkeypatch.setattr("strategies.step.precision_support.cpu_fp16_supported", lambda: False)


@pytest.mark.parametrize(
    "launch,backend",
    [
        (["--strategy", "zero2"], "zero2"),
        (["--deepspeed-config", "configs/deepspeed/zero3.json"], "zero3"),
        (
            ["--strategy", "accelerate", "--accelerate-config", "configs/accelerate/deepspeed_zero2.yaml"],
            "Accelerate's DeepSpeed plugin",
        ),
    ],
)
def test_fp16_where_deepspeed_cannot_run_it_is_refused_before_launch_by_name(
    no_cpu_fp16, launch, backend, tmp_path, capsys
):
    from launchers.cli import main

    out = tmp_path / "out"
    run = ["run", "quickstart", *launch, "--nproc-per-node", "2", "--out", str(out)]
    assert main([*run, "--set", "training.precision=fp16"]) == 2
    err = capsys.readouterr().err
    assert f"training.precision: fp16 under {backend} cannot run on this cpu machine" in err
    assert "which this CPU (" in err and "AVX512-FP16" in err and "set training.precision=bf16" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()  # one line, and nothing started
    # the fix the message gives passes every check before launch
    assert main([*run, "--set", "training.precision=bf16", "--dry-run"]) == 0


def test_fp16_under_autocast_needs_no_fp16_kernels(no_cpu_fp16):
    """Autocast and FSDP's mixed precision compute fp16 on any CPU: only DeepSpeed's engine asks."""
    from strategies.lifecycle.preflight import preflight

    for strategy in ("ddp", "fsdp2"):
        cfg = parse_experiment(experiment("bspline", STRATEGIES[strategy], 1, "runs", precision="fp16"))
        assert preflight(cfg, "cpu", 2).global_batch == 64


def test_the_fp16_check_answers_as_deepspeeds_own_cpu_accelerator():
    """Asked without starting DeepSpeed; DeepSpeed's answer (None for no) must be the same."""
    from strategies.step.precision_support import cpu_fp16_supported
    from tests.helpers.launch import run

    ask = "from deepspeed.accelerator import get_accelerator; print(bool(get_accelerator().is_fp16_supported()))"
    answer = run([sys.executable, "-c", ask], timeout=120, DS_ACCELERATOR="cpu").stdout.split()[-1]
    assert answer == str(cpu_fp16_supported())


@pytest.mark.skipif(cpu_fp16_supported(), reason="this CPU has oneDNN fp16 kernels: DeepSpeed runs fp16 here")
def test_on_this_cpu_fp16_under_deepspeed_is_refused_without_forcing(tmp_path, capsys):
    from launchers.cli import main

    assert (
        main(
            [
                "run",
                "quickstart",
                "--strategy",
                "zero1",
                "--nproc-per-node",
                "2",
                "--out",
                str(tmp_path),
                "--set",
                "training.precision=fp16",
            ]
        )
        == 2
    )
    assert "fp16 under zero1 cannot run on this cpu machine" in capsys.readouterr().err


def test_precision_is_an_axis_the_analysis_keeps_apart(tmp_path):
    """Runs that differ only in precision are different strategies in the tables, and each is
    measured against the one-process run of its own precision."""
    for record in (
        make_record("s32", strategy="single", samples_per_s=1000.0),
        make_record("s16", strategy="single", samples_per_s=2000.0, precision="bf16"),
        make_record("d16", strategy="ddp", world=2, micro_batch=32, samples_per_s=3000.0, precision="bf16"),
    ):
        write_record(tmp_path, record)
    runs = derive(load_runs(tmp_path)[0]).set_index("run_id")
    assert runs.loc["d16", "strategy_label"] == "ddp+bf16" and runs.loc["s32", "strategy_label"] == "single"
    assert runs.loc["d16", "speedup"] == pytest.approx(1.5)  # against single+bf16, not single in fp32


def test_the_verdict_measures_each_precision_against_one_process_of_the_same_precision(tmp_path):
    from analysis.report.verdict import verdict

    for record in (
        make_record("s32", strategy="single", samples_per_s=1000, window=(950, 1050)),
        make_record("s16", strategy="single", samples_per_s=600, window=(580, 620), precision="bf16"),
        make_record("d32", world=2, micro_batch=32, samples_per_s=800, window=(780, 820)),
        make_record("d16", world=2, micro_batch=32, samples_per_s=700, window=(680, 720), precision="bf16"),
    ):
        write_record(tmp_path, record)
    runs = load_runs(tmp_path)[0]
    (scale,) = verdict(derive(runs), runs[runs["status"] != "ok"]).scales
    findings = dict(scale.findings)
    # ddp+bf16 is slower than single in fp32 but faster than single in bf16: it scales
    assert findings["Does not scale"] == (
        "slower than one process of the same precision: ddp at 2 ranks (800 samples/s "
        "[780-820]) against single at 1 rank (1,000 samples/s [950-1,050])"
    )
    assert any("bf16 is slower than fp32 here (0.60x in one process" in text for text in scale.caveats)
