"""The DeepSpeed configs Transformers and Accelerate publish, as published (tests/data/hf_deepspeed/,
README.md there names their commits), on every route a user takes them: ``kanscale train
--deepspeed-config``, ``kanscale run --deepspeed-config`` and an accelerate launch config's
``deepspeed_config_file``. Each trains with its stage, offload and precision in the record, or is
refused before launch for what this machine cannot do (fp16 under DeepSpeed on a CPU without
oneDNN fp16), and its optimizer, scheduler and precision blocks are taken into the experiment."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from analysis.records.run_files import read_steps, read_summary
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import load_experiment
from strategies.native_training import with_native_training
from strategies.step.precision_support import cpu_fp16_supported, deepspeed_lacks
from tests.helpers.launch import ROOT, child_env

TEMPLATES = ROOT / "tests/data/hf_deepspeed"
# file -> (stage, optimizer offload, parameter offload, the precision it enables)
PUBLISHED = {
    "ds_config_zero2.json": (2, "cpu", "none", "fp32"),  # fp16/bf16 "auto": the experiment's fp32
    "ds_config_zero3.json": (3, "cpu", "cpu", "fp16"),
    "zero_stage1_config.json": (1, "none", "none", "fp16"),
    "zero_stage2_config.json": (2, "none", "none", "fp16"),
    "zero_stage3_offload_config.json": (3, "cpu", "cpu", "fp16"),
}
# what this machine lacks, in the words the suite refuses fp16 under DeepSpeed with (None: nothing)
FP16_LACK = deepspeed_lacks("fp16", "cpu")


def experiment_file(tmp_path: Path, **training) -> Path:
    """An experiment that leaves the optimizer, learning rate and precision to the file."""
    data = {
        "name": "hf",
        "model": {"family": "bspline", "widths": [2, 16, 1], "grid": 5, "grid_range": [-2, 2]},
        "task": {"name": "quadratic", "n_train": 2048, "n_test": 128},
        "training": {"seed": 0, "micro_batch": 64, "steps": 6, "warmup_steps": 1, **training},
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def refused_here(precision: str) -> bool:
    return precision == "fp16" and not cpu_fp16_supported()


def kanscale(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=child_env(DS_ACCELERATOR="cpu"),
    )


def assert_trained_as_the_file_says(run_dir: Path, name: str) -> None:
    stage, offload_optimizer, offload_param, precision = PUBLISHED[name]
    record = read_summary(run_dir)
    zero = record.strategy.backend_config["zero_optimization"]
    assert record.status == "ok" and zero["stage"] == stage
    devices = tuple((zero.get(block) or {}).get("device", "none") for block in ("offload_optimizer", "offload_param"))
    assert devices == (offload_optimizer, offload_param)  # a block the file leaves out offloads nothing
    assert record.precision.setting == precision
    assert "optimizer" not in record.strategy.backend_config  # the suite's own optimizer ran
    assert ": scheduler.type = " in record.strategy.adopted["training.schedule.name"]  # where it came from
    assert all(s.lr is not None for s in read_steps(run_dir))


def assert_refused_for_fp16(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "training.precision: fp16 under" in proc.stderr and FP16_LACK in proc.stderr


# ------------------------------------------------------------------------ taken into the experiment


def test_the_published_files_are_stored_as_published():
    readme = (TEMPLATES / "README.md").read_text()
    for name in PUBLISHED:
        json.loads((TEMPLATES / name).read_text())  # valid JSON, unedited
        assert name in readme
    assert "optimizer" in json.loads((TEMPLATES / "ds_config_zero3.json").read_text())


def test_concrete_values_are_adopted_and_recorded_with_their_keys(tmp_path):
    name = str(TEMPLATES / "ds_config_zero3.json")
    cfg = with_native_training(
        load_experiment(experiment_file(tmp_path), [f"strategy={{name: deepspeed, config: {name}}}"])
    )
    t = cfg.training
    assert (t.optimizer, t.lr, t.betas, t.eps, t.weight_decay) == ("adamw", 3e-5, (0.8, 0.999), 1e-8, 3e-7)
    assert (t.schedule.name, t.schedule.warmup_steps, t.schedule.warmup_min_lr, t.precision) == (
        "warmup",
        500,
        0,
        "fp16",
    )
    assert t._adopted["training.lr"] == f"{name}: optimizer.params.lr = 3e-05"
    assert t._adopted["training.betas"] == f"{name}: optimizer.params.betas = [0.8, 0.999]"
    assert t._adopted["training.precision"] == f"{name}: fp16.enabled = true"
    # zero_optimization.reduce_bucket_size 0 (each gradient on its own), which DeepSpeed 0.19 refuses,
    # reaches DeepSpeed and the record as 1, the same bucketing
    assert cfg.strategy.resolve(t, 2)["zero_optimization"]["reduce_bucket_size"] == 1
    assert cfg.strategy.resolved(cfg.model).reduce_bucket_size == 1


def test_a_zero_value_deepspeed_refuses_is_named_before_launch(tmp_path):
    native = tmp_path / "ds.json"
    native.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}))
    cfg = load_experiment(experiment_file(tmp_path), [f"strategy={{name: deepspeed, config: {native}}}"])
    with pytest.raises(ConfigError) as refused:
        cfg.strategy.resolve(cfg.training, 2)
    assert f"zero_optimization.stage3_max_live_parameters is -1 in {native}, which DeepSpeed refuses" in str(
        refused.value
    )


def test_auto_values_are_filled_from_the_experiment(tmp_path):
    cfg = with_native_training(
        load_experiment(
            experiment_file(tmp_path, lr=0.004),
            ["strategy.name=deepspeed", f"strategy.config={TEMPLATES / 'zero_stage2_config.json'}"],
        )
    )
    t = cfg.training
    assert (
        t.lr == 0.004
        and t.optimizer == "adamw"
        and t.schedule.name == "warmup_decay"
        and t.schedule.total_steps is None
    )
    assert "training.lr" not in t._adopted and t._adopted["training.precision"].endswith("fp16.enabled = true")


def test_a_conflict_names_both_sides_and_the_set_lines_that_resolve_it(tmp_path):
    name = str(TEMPLATES / "ds_config_zero3.json")
    overrides = ["strategy.name=deepspeed", f"strategy.config={name}"]
    with pytest.raises(ConfigError) as refused:
        with_native_training(load_experiment("quickstart", overrides))
    message = str(refused.value)
    assert f"strategy.config: {name} cannot run as given" in message
    assert "optimizer.params.lr is 3e-05, but the experiment sets training.lr to 0.01" in message
    assert 'optimizer.type is "AdamW", but the experiment sets training.optimizer to adam' in message
    fix = message.split("to train with the file's values: ")[1].split(";")[0]
    assert fix == (
        "--set training.optimizer=adamw --set training.lr=3e-05 --set training.betas=[0.8,0.999] "
        "--set training.weight_decay=3e-07"
    )
    followed = fix.replace("--set ", "").split(" ")
    cfg = with_native_training(load_experiment("quickstart", [*overrides, *followed]))  # the advice works
    assert (cfg.training.lr, cfg.training.betas) == (3e-5, (0.8, 0.999))


def test_a_file_value_the_strategy_refuses_is_named_by_file_and_full_key(tmp_path):
    native = json.loads((TEMPLATES / "zero_stage2_config.json").read_text())
    native["zero_optimization"]["reduce_bucket_size"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(native))
    with pytest.raises(ConfigError) as refused:
        load_experiment(experiment_file(tmp_path), ["strategy.name=deepspeed", f"strategy.config={path}"])
    message = str(refused.value)
    assert f"zero_optimization.reduce_bucket_size is -1 in {path}" in message
    assert "--set strategy.reduce_bucket_size=VALUE" in message
    cfg = load_experiment(
        experiment_file(tmp_path),
        ["strategy.name=deepspeed", f"strategy.config={path}", "strategy.reduce_bucket_size=1000"],
    )  # the advice works
    assert cfg.strategy.reduce_bucket_size == 1000


def test_an_optimizer_or_scheduler_the_suite_cannot_build_is_refused_naming_the_key(tmp_path):
    native = json.loads((TEMPLATES / "ds_config_zero2.json").read_text())
    native["optimizer"]["type"] = "Lamb"
    native["scheduler"]["type"] = "OneCycle"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(native))
    cfg = load_experiment(experiment_file(tmp_path), ["strategy.name=deepspeed", f"strategy.config={path}"])
    with pytest.raises(
        ConfigError,
        match=r"optimizer\.type is 'Lamb', which the suite does not build.*scheduler\.type "
        r"is 'OneCycle'; the suite runs DeepSpeed's WarmupLR, WarmupDecayLR",
    ):
        with_native_training(cfg)


# ------------------------------------------------------------------------ the routes, as users take them


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_run_dry_run_takes_every_file_or_refuses_it_for_this_machine(tmp_path, capsys, name):
    code = main(
        [
            "run",
            str(experiment_file(tmp_path)),
            "--deepspeed-config",
            str(TEMPLATES / name),
            "--launcher",
            "deepspeed",
            "--nproc-per-node",
            "2",
            "--dry-run",
        ]
    )
    captured = capsys.readouterr()
    if refused_here(PUBLISHED[name][3]):
        assert code == 2 and "training.precision: fp16 under zero" in captured.err and FP16_LACK in captured.err
        return
    assert code == 0, captured.err
    assert f'"stage": {PUBLISHED[name][0]}' in captured.out and '"scheduler"' not in captured.out


def test_kanscale_train_trains_the_transformers_zero2_file(tmp_path):
    name = "ds_config_zero2.json"
    proc = kanscale("train", str(experiment_file(tmp_path)), "--deepspeed-config", str(TEMPLATES / name))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    assert_trained_as_the_file_says(run_dir, name)
    lrs = [s.lr for s in read_steps(run_dir)]
    assert lrs[:2] == [0.0, 0.0] and lrs[-1] == 1e-3  # WarmupLR from warmup_min_lr "auto" (0) to training.lr


@pytest.mark.slow  # five launches of two ranks
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_kanscale_run_with_two_ranks(tmp_path, name):
    proc = kanscale(
        "run", str(experiment_file(tmp_path)), "--deepspeed-config", str(TEMPLATES / name), "--nproc-per-node", "2"
    )
    if refused_here(PUBLISHED[name][3]):
        assert_refused_for_fp16(proc)
        assert not (tmp_path / "runs").exists()  # before launch: no run started
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained_as_the_file_says(next((tmp_path / "runs").iterdir()), name)


@pytest.mark.slow  # five accelerate launches of two ranks
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_accelerates_deepspeed_config_file(tmp_path, name):
    launch = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "num_machines": 1,
        "machine_rank": 0,
        "use_cpu": True,
        "deepspeed_config": {"deepspeed_config_file": str(TEMPLATES / name)},
    }
    launch_file = tmp_path / "accelerate.yaml"
    launch_file.write_text(yaml.safe_dump(launch))
    proc = kanscale(
        "run",
        str(experiment_file(tmp_path)),
        "--strategy",
        "accelerate",
        "--accelerate-config",
        str(launch_file),
        "--nproc-per-node",
        "2",
    )
    if refused_here(PUBLISHED[name][3]):
        assert_refused_for_fp16(proc)
        assert not (tmp_path / "runs").exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    assert_trained_as_the_file_says(run_dir, name)
    assert read_summary(run_dir).strategy.distributed_type == "DEEPSPEED"


def test_whole_blocks_written_as_auto_train_from_the_experiment(tmp_path):
    """Transformers' templates may write a whole block as "auto": ``"params": "auto"`` of the
    optimizer and the scheduler, ``"fp16": "auto"``; each is read as the block with every key
    "auto", filled from the experiment (the warm-up's steps and range, the precision)."""
    native = json.loads((TEMPLATES / "ds_config_zero2.json").read_text())
    native["optimizer"]["params"] = "auto"
    native["scheduler"] = {"type": "WarmupDecayLR", "params": "auto"}
    native["fp16"], native["bf16"] = "auto", "auto"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(native))
    proc = kanscale("train", str(experiment_file(tmp_path, lr=0.004)), "--deepspeed-config", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    lrs = [s.lr for s in read_steps(run_dir)]
    assert lrs[0] == 0.0 and max(lrs) <= 0.004 and read_summary(run_dir).precision.setting == "fp32"


@pytest.mark.parametrize(
    "blocks, says",
    [
        ({"zero_optimization": "auto"}, 'zero_optimization is "auto", not a block of keys; in '),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": "auto"}}, "zero_optimization.offload_optimizer is"),
        ({"zero_optimization": {"stage": 2}, "fp16": 1, "optimizer": []}, "fp16 is 1, not a block of keys"),
        ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": 3}}, "scheduler.params is 3"),
    ],
)
def test_a_block_that_is_not_one_is_named_with_what_to_write(tmp_path, capsys, blocks, says):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(blocks))
    argv = ["run", str(experiment_file(tmp_path)), "--deepspeed-config", str(path), "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "Error:" not in err
