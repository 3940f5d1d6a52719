"""`kanscale train` under each real launcher, two ranks on this CPU: torchrun, the deepspeed
launcher and accelerate launch (multi-CPU DDP and the DeepSpeed plugin)."""

import sys

import pytest

from analysis.records.run_files import read_summary
from tests.helpers.launch import ROOT, run

# The slow tier (make test-slow, run by .ci/run): torchrun, accelerate launch and the deepspeed
# launcher started as users start them.
pytestmark = pytest.mark.slow

TRAIN = [
    "-m",
    "launchers.cli",
    "train",
    str(ROOT / "configs/experiments/quickstart.yaml"),
    "--no-progress",
    "--set",
    "training.steps=12",
    "--set",
    "training.micro_batch=128",
    "--set",
    "measurement.baseline_steps=2",
]


def only_record(out):
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs  # one record per run, written by rank 0
    return read_summary(runs[0])


def test_torchrun(tmp_path):
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *TRAIN,
            "--out",
            str(tmp_path),
            "--set",
            "strategy.name=fsdp2",
        ]
    )
    record = only_record(tmp_path)
    assert (record.status, record.topology.world_size, record.topology.launcher) == ("ok", 2, "torchrun")
    assert (record.topology.comm_backend, record.topology.nodes) == ("gloo", 1)
    assert proc.stdout.count("test mse") == 1  # only rank 0 prints the summary


def test_deepspeed_launcher(tmp_path):
    run(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--module",
            *TRAIN[1:],
            "--out",
            str(tmp_path),
            "--set",
            "strategy.name=deepspeed",
            "--set",
            "strategy.zero_stage=3",
        ],
        DS_ACCELERATOR="cpu",
    )
    record = only_record(tmp_path)
    assert (record.status, record.topology.world_size, record.topology.launcher) == ("ok", 2, "deepspeed")
    assert record.strategy.distributed_type == "DEEPSPEED_ZERO3"
    assert (record.strategy.label, record.strategy.options["zero_stage"]) == ("zero3", 3)


@pytest.mark.parametrize(
    "config,distributed_type,label",
    [("ddp_cpu.yaml", "MULTI_CPU", "accelerate_ddp"), ("deepspeed_zero2.yaml", "DEEPSPEED", "accelerate_zero2")],
)
def test_accelerate_launch(tmp_path, config, distributed_type, label):
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    run(
        [
            *accelerate,
            "--config_file",
            str(ROOT / "configs/accelerate" / config),
            "--num_processes=2",
            *TRAIN,
            "--out",
            str(tmp_path),
            "--set",
            "strategy.name=accelerate",
        ]
    )
    record = only_record(tmp_path)
    assert (record.status, record.topology.world_size, record.topology.launcher) == ("ok", 2, "accelerate")
    assert record.strategy.distributed_type == distributed_type
    assert record.strategy.label == label  # the backend Accelerate chose, in the strategies' vocabulary


@pytest.mark.parametrize("refused", ["NO", "MULTI_CPU"])
def test_the_fix_the_one_process_refusal_recommends_starts_every_rank(tmp_path, refused, capsys):
    """Follow the message: a launch config accelerate would start one process for, given 2 ranks,
    is refused; changed as the message says, it trains at world size 2."""
    from launchers.cli import main

    launch = tmp_path / "launch.yaml"
    launch.write_text(
        f"compute_environment: LOCAL_MACHINE\ndistributed_type: {refused}\nmixed_precision: 'no'\nuse_cpu: true\n"
    )
    command = [
        "run",
        "quickstart",
        "--strategy",
        "accelerate",
        "--launcher",
        "accelerate",
        "--accelerate-config",
        str(launch),
        "--nproc-per-node",
        "2",
        "--out",
        str(tmp_path / "runs"),
        "--set",
        "training.steps=12",
        "--set",
        "training.micro_batch=128",
        "--set",
        "measurement.baseline_steps=2",
    ]
    assert main(command) == 2
    assert "set distributed_type: MULTI_GPU with use_cpu: true" in capsys.readouterr().err
    launch.write_text(launch.read_text().replace(f"distributed_type: {refused}", "distributed_type: MULTI_GPU"))
    assert main(command) == 0
    record = only_record(tmp_path / "runs")
    assert (record.status, record.topology.world_size, record.strategy.distributed_type) == ("ok", 2, "MULTI_CPU")


@pytest.mark.parametrize(
    "config,mechanism",
    [("ddp_cpu.yaml", "Accelerate mixed_precision=bf16"), ("deepspeed_zero2.yaml", "DeepSpeed bf16")],
)
def test_an_accelerate_launch_config_that_sets_bf16_runs_an_experiment_that_asks_for_bf16(tmp_path, config, mechanism):
    launch = tmp_path / config
    launch.write_text(
        (ROOT / "configs/accelerate" / config).read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16")
    )
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    run(
        [
            *accelerate,
            "--config_file",
            str(launch),
            "--num_processes=2",
            *TRAIN,
            "--out",
            str(tmp_path / "runs"),
            "--set",
            "strategy.name=accelerate",
            "--set",
            "training.precision=bf16",
        ]
    )
    record = only_record(tmp_path / "runs")
    assert record.status == "ok" and record.precision.mechanism == mechanism
    assert (record.precision.setting, record.precision.compute_dtype) == ("bf16", "bfloat16")
