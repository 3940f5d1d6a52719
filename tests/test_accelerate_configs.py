"""Accelerate's launch configs: validated against the experiment before anything runs (the
process count, MPI for multi-CPU, FSDP on a CPU, conflicting values), and Accelerate's plugin
objects built from the shipped configs."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from kan_models import build_model, parse_model_config
from kanscale.errors import ConfigError
from strategies.backends.accelerate import AccelerateConfig
from strategies.backends.accelerate_launch import launch_config_conflicts
from strategies.backends.deepspeed_config import resolve_native
from strategies.experiment import load_experiment
from strategies.lifecycle.preflight import preflight
from strategies.sections import TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"
ACCELERATE = ROOT / "configs/accelerate"
MODEL = parse_model_config({"family": "bspline", "widths": [2, 16, 1]})


def accelerate_launch_env(config: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file CONFIG` gives its processes, built by
    Accelerate's own launch code; the shipped configs leave the process count to the command line."""
    args = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", "2", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if defaults.distributed_type.name == "DEEPSPEED":
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


def test_shipped_accelerate_configs_load_with_accelerate():
    kinds = {p.stem: load_config_from_file(str(p)).distributed_type.name for p in ACCELERATE.glob("*.yaml")}
    assert kinds == {
        "ddp": "MULTI_GPU",
        "ddp_cpu": "MULTI_GPU",
        "fsdp1": "FSDP",
        "fsdp2": "FSDP",
        "deepspeed_zero2": "DEEPSPEED",
        "deepspeed_zero3": "DEEPSPEED",
    }


def kan_model():
    model = build_model(parse_model_config({"family": "bspline", "widths": [2, 8, 8, 1]}), seed=0)
    model._no_split_modules = sorted({type(b).__name__ for b in model.blocks})  # as the accelerate strategy does
    return model


def test_fsdp2_plugin_wraps_one_unit_per_kan_layer(monkeypatch):
    for key, value in accelerate_launch_env(ACCELERATE / "fsdp2.yaml").items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    model = kan_model()
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [m for m in model.modules() if policy(m)] == model.blocks


def test_fsdp1_plugin_wraps_one_unit_per_kan_layer(monkeypatch):
    for key, value in accelerate_launch_env(ACCELERATE / "fsdp1.yaml").items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    model = kan_model()
    plugin.set_auto_wrap_policy(model)
    wrapped = [m for m in model.modules() if plugin.auto_wrap_policy(m, recurse=False, nonwrapped_numel=10**9)]
    assert plugin.fsdp_version == 1 and wrapped == model.blocks


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_plugin_gets_the_experiments_values(monkeypatch, stage):
    for key, value in accelerate_launch_env(ACCELERATE / f"deepspeed_zero{stage}.yaml").items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    training = TrainingConfig(micro_batch=64, grad_accum=2, grad_clip=0.5)
    resolution = resolve_native(plugin.deepspeed_config, training, world_size=2, hidden=16, source="the plugin")
    assert resolution.problems == [] and resolution.unchecked == []
    assert resolution.config["gradient_clipping"] == 0.5 and resolution.config["train_batch_size"] == 256
    plugin.deepspeed_config["gradient_clipping"] = 1.0
    assert resolve_native(plugin.deepspeed_config, training, 2, 16, "the plugin").problems == [
        "gradient_clipping is 1.0, but the experiment sets training.grad_clip to 0.5",
        "to train with the file's values: --set training.grad_clip=1.0; to keep the experiment's: set "
        'gradient_clipping to "auto" in the plugin',
    ]
    followed = training.model_copy(update={"grad_clip": 1.0})  # what the --set line does
    assert resolve_native(plugin.deepspeed_config, followed, 2, 16, "the plugin").problems == []


def test_accelerate_fsdp_is_refused_on_cpu_before_launch():
    cfg = load_experiment(
        QUICKSTART, ["strategy.name=accelerate", "strategy.config_file=configs/accelerate/fsdp2.yaml"]
    )
    with pytest.raises(ConfigError, match=r"accelerate \+ FSDP needs CUDA devices here.*use strategy fsdp2"):
        preflight(cfg, "cpu", 2)
    preflight(cfg, "cuda", 2)  # the same config is fine where there are GPUs


def test_accelerate_fsdp_is_refused_at_run_time_on_cpu(monkeypatch):
    for key, value in accelerate_launch_env(ACCELERATE / "fsdp2.yaml").items():
        monkeypatch.setenv(key, value)
    from strategies.runtime.distributed import DistEnv

    with pytest.raises(ConfigError, match="accelerate \\+ FSDP needs CUDA devices here"):
        AccelerateConfig(name="accelerate").apply(kan_model(), TrainingConfig(), DistEnv(world_size=2))


def test_an_accelerate_config_that_starts_one_process_is_refused_for_two_ranks(tmp_path):
    """`accelerate config default` writes distributed_type: NO; launched with 2 ranks Accelerate
    would start one process and exit 0. Refused before launch, naming the key."""
    default = tmp_path / "default_config.yaml"
    default.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: 'no'\n"
        "num_processes: 1\nuse_cpu: true\n"
    )
    from launchers.cli import main

    assert (
        main(
            [
                "run",
                "quickstart",
                "--strategy",
                "accelerate",
                "--launcher",
                "accelerate",
                "--accelerate-config",
                str(default),
                "--nproc-per-node",
                "2",
                "--dry-run",
            ]
        )
        == 2
    )
    assert launch_config_conflicts({"distributed_type": "NO"}, TrainingConfig(), "cpu", 2, model=MODEL) == [
        "distributed_type: NO starts one process, but 2 ranks were asked for; set distributed_type: MULTI_GPU with "
        "use_cpu: true (configs/accelerate/ddp_cpu.yaml: torchrun starts the ranks and the Accelerator runs MULTI_CPU "
        "over gloo)"
    ]
    assert launch_config_conflicts({"distributed_type": "NO"}, TrainingConfig(), "cpu", 1, model=MODEL) == []
    assert launch_config_conflicts({"distributed_type": "NO"}, TrainingConfig(), "cuda", 2, model=MODEL) == [
        "distributed_type: NO starts one process, but 2 ranks were asked for; set distributed_type: MULTI_GPU"
    ]


def test_accelerate_multi_cpu_without_mpi_is_refused_when_more_ranks_are_asked_for(tmp_path):
    """accelerate launch has no launcher for MULTI_CPU but mpirun: without an mpirun hostfile it
    starts one process, which trained alone and exited 0 (the record said world size 1)."""
    multi_cpu = {"distributed_type": "MULTI_CPU", "use_cpu": True}
    (problem,) = launch_config_conflicts(multi_cpu, TrainingConfig(), "cpu", 2, model=MODEL)
    assert problem.startswith(
        "distributed_type: MULTI_CPU starts one process unless MPI is configured "
        "(mpirun_config.mpirun_hostfile), but 2 ranks were asked for; set distributed_type: MULTI_GPU "
        "with use_cpu: true"
    )
    assert launch_config_conflicts(multi_cpu, TrainingConfig(), "cpu", 1, model=MODEL) == []
    with_mpi = {**multi_cpu, "mpirun_config": {"mpirun_hostfile": str(tmp_path / "hosts")}}
    assert launch_config_conflicts(with_mpi, TrainingConfig(), "cpu", 2, model=MODEL) == []
    launch = tmp_path / "multi_cpu.yaml"
    launch.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\nuse_cpu: true\n"
    )
    from launchers.cli import main

    assert (
        main(
            [
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
                "--dry-run",
            ]
        )
        == 2
    )


def test_accelerate_launch_config_conflicts():
    launch = {
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "deepspeed_config": {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0},
    }
    problems = launch_config_conflicts(launch, TrainingConfig(grad_accum=2), "cuda", model=MODEL)
    assert problems == [
        "mixed_precision='bf16' but training.precision is fp32; set mixed_precision: 'no' (or "
        "training.precision to match)",
        "deepspeed_config.gradient_accumulation_steps=4 but the experiment sets 2",
        "deepspeed_config.gradient_clipping=1.0 but the experiment sets 0.0",
    ]
    # The experiment asking for bf16 lifts the refusal; 'no' (accelerate config's default) defers to it.
    bf16 = TrainingConfig(grad_accum=4, grad_clip=1.0, precision="bf16")
    assert launch_config_conflicts(launch, bf16, "cuda", model=MODEL) == []
    assert launch_config_conflicts({**launch, "mixed_precision": "no"}, bf16, "cuda", model=MODEL) == []
    assert launch_config_conflicts({**launch, "mixed_precision": "fp16"}, bf16, "cuda", model=MODEL) == [
        "mixed_precision='fp16' but training.precision is bf16; set mixed_precision: 'bf16' (or training.precision to "
        "match)"
    ]
