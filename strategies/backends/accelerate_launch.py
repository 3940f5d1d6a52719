"""Accelerate's launch config files (``accelerate launch --config_file``), checked against the
experiment before launch: keys accelerate does not know, a distributed type or precision that
cannot run the launch here, and the DeepSpeed JSON a DeepSpeed-plugin config names, checked as the
deepspeed strategy checks its own. The accelerate backend (accelerate.py) and ``kanscale run``
both ask :func:`launch_config_conflicts`."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any

from kan_models.base import ModelConfig
from kanscale.extras import require
from kanscale.files import read_mapping
from strategies.backends.deepspeed_config import hidden_size, resolve_native, warn_unchecked
from strategies.backends.deepspeed_training import adopt
from strategies.sections import TrainingConfig
from strategies.step.precision_support import deepspeed_lacks, precision_problem

# training.precision -> Accelerate's mixed_precision
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
FP16_CPU_MESSAGE = (
    "training.precision: Accelerate does not autocast fp16 on CPUs (it would train in float32 and "
    "report fp16); use bf16 on a CPU, or the DeepSpeed plugin"
)
DEEPSPEED_PLUGIN = "accelerate's DeepSpeed plugin (distributed_type: DEEPSPEED)"
GPU_ONLY_MESSAGE = (
    "accelerate + FSDP needs CUDA devices here (Accelerate's FSDP plugin does not run on CPUs); "
    "use strategy fsdp2 or fsdp1 on CPU"
)


# Keys accelerate still reads and converts (BaseConfig.process_config), though its config
# classes no longer have them
LEGACY_LAUNCH_KEYS = frozenset({"fp16", "dynamo_backend"})
# accelerate launch copies these sections' keys onto its command-line options, prefixing some
# (accelerate.commands.launch._validate_launch_command), and ignores a key that is no option.
# fp8_config is not among them: `accelerate config` writes keys there that are no launch option.
SECTION_PREFIXES = {
    "deepspeed_config": "",
    "fsdp_config": "fsdp_",
    "dynamo_config": "dynamo_",
    "megatron_lm_config": "",
    "parallelism_config": "",
    "mpirun_config": "",
}


def unknown_launch_keys(launch: dict[str, Any]) -> list[str]:
    """An accelerate launch config's keys that accelerate does not know, each with the closest
    known key where one is close: a top-level one makes ``accelerate launch`` fail after it
    started, one inside a plugin section (``deepspeed_config.zero_stgae``) is silently ignored."""
    if importlib.util.find_spec("accelerate") is None:
        return []  # not installed: the launch is refused for that
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
    from accelerate.commands.launch import launch_command_parser

    kind = SageMakerConfig if launch.get("compute_environment") == "AMAZON_SAGEMAKER" else ClusterConfig
    known = sorted(set(kind.__dataclass_fields__) | LEGACY_LAUNCH_KEYS)
    options = sorted({action.dest for action in launch_command_parser()._actions})
    problems = [describe_unknown(key, key, known, "accelerate launch refuses it") for key in launch if key not in known]
    for section, prefix in SECTION_PREFIXES.items():
        for key in launch[section] if isinstance(launch.get(section), dict) else {}:
            option = key if key.startswith(prefix) else prefix + key
            if option not in options:
                problems.append(describe_unknown(f"{section}.{key}", option, options, "accelerate launch ignores it"))
    return problems


def describe_unknown(shown: str, key: str, known: list[str], consequence: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}?" if close else "remove it"
    return f"{shown}: not a key accelerate knows ({consequence}); {hint}"


def mpi_configured(launch: dict[str, Any]) -> bool:
    """Whether an accelerate launch config gives mpirun a hostfile, with which accelerate launch
    starts MULTI_CPU's processes."""
    return bool((launch.get("mpirun_config") or {}).get("mpirun_hostfile"))


def launch_config_conflicts(
    launch: dict[str, Any], training: TrainingConfig, device_type: str, world_size: int = 1, *, model: ModelConfig
) -> list[str]:
    """What an accelerate launch config says that the experiment contradicts or that cannot
    run ``world_size`` ranks on ``device_type``; the DeepSpeed JSON it names is checked as the
    deepspeed strategy checks its own (and its unchecked keys are warned about)."""
    problems = unknown_launch_keys(launch)
    fsdp = launch.get("fsdp_config")
    if isinstance(fsdp, dict) and fsdp.get("fsdp_activation_checkpointing") not in (None, False):
        # Accelerate's FSDP plugin would wrap layers of its own choosing, unrecorded, and on top of
        # the suite's own checkpointing where both were asked for
        problems.append(
            "fsdp_config.fsdp_activation_checkpointing: the suite checkpoints activations itself, under every "
            "strategy and in the run record; remove the key and set training.activation_checkpointing=layers"
        )
    kind = launch.get("distributed_type")
    kind = "NO" if kind is False else kind  # YAML 1.1 reads an unquoted NO as false
    if kind == "DEEPSPEED":
        require("hf", DEEPSPEED_PLUGIN)
    native_file = Path(str((launch.get("deepspeed_config") or {}).get("deepspeed_config_file") or ""))
    if kind == "DEEPSPEED" and native_file.is_file():
        # the file's precision (an fp16 block enabled) is the run's where the experiment sets none
        training = adopt(
            read_mapping(native_file, "deepspeed_config.deepspeed_config_file", what="a JSON object"),
            training,
            str(native_file),
        ).training
    one_process = {
        "NO": "starts one process",
        # accelerate launch has no launcher of its own for MULTI_CPU but mpirun's
        "MULTI_CPU": "starts one process unless MPI is configured (mpirun_config.mpirun_hostfile)",
    }
    if kind in one_process and world_size > 1 and not (kind == "MULTI_CPU" and mpi_configured(launch)):
        # `accelerate config default` writes NO, and MULTI_CPU reads like the answer on a CPU;
        # under either accelerate launch starts one process, which trains alone and exits 0.
        fix = (
            "distributed_type: MULTI_GPU"
            if device_type == "cuda"
            else "distributed_type: MULTI_GPU with use_cpu: true (configs/accelerate/ddp_cpu.yaml: torchrun starts "
            "the ranks and the Accelerator runs MULTI_CPU over gloo)"
        )
        problems.append(
            f"distributed_type: {kind} {one_process[kind]}, but {world_size} ranks were asked for; set {fix}"
        )
    if kind == "FSDP" and device_type != "cuda":
        problems.append(GPU_ONLY_MESSAGE)
    if training.precision == "fp16" and device_type == "cpu" and kind != "DEEPSPEED":
        problems.append(FP16_CPU_MESSAGE)
    if kind == "DEEPSPEED" and (
        problem := precision_problem(training.precision, device_type, "Accelerate's DeepSpeed plugin", deepspeed_lacks)
    ):
        problems.append(problem)
    ds = launch.get("deepspeed_config") or {}
    if kind == "DEEPSPEED" and ds.get("deepspeed_config_file"):
        return problems + deepspeed_file_problems(launch, training, world_size, model)
    precision = launch.get("mixed_precision") or "no"
    if precision not in ("no", MIXED_PRECISION[training.precision]):
        # 'no' is what `accelerate config` writes by default; the experiment's precision is passed to
        # the Accelerator and decides. A launch config asking for another low precision contradicts it.
        problems.append(
            f"mixed_precision={precision!r} but training.precision is {training.precision}; set "
            f"mixed_precision: {MIXED_PRECISION[training.precision]!r} (or training.precision to match)"
        )
    owned = {"gradient_accumulation_steps": training.grad_accum, "gradient_clipping": training.grad_clip}
    for key, value in owned.items():
        if ds.get(key) not in (None, "auto") and float(ds[key]) != float(value):
            problems.append(f"deepspeed_config.{key}={ds[key]!r} but the experiment sets {value!r}")
    return problems


# Launch config keys Accelerate refuses beside a deepspeed_config_file, after launch
# (DeepSpeedPlugin._deepspeed_config_checks): the JSON decides them.
DECIDED_BY_THE_FILE = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)


def deepspeed_file_problems(
    launch: dict[str, Any], training: TrainingConfig, world_size: int, model: ModelConfig
) -> list[str]:
    """An accelerate launch config's ``deepspeed_config_file`` and what Accelerate requires beside it."""
    path = Path(str(launch["deepspeed_config"]["deepspeed_config_file"]))
    problems = []
    if launch.get("mixed_precision") is not None:
        problems.append(
            f"remove mixed_precision: Accelerate refuses it beside deepspeed_config.deepspeed_config_file "
            f"(the precision comes from the fp16/bf16 blocks of {path}, which the experiment's "
            f'training.precision={training.precision} fills when they are "auto" or absent)'
        )
    problems += [
        f"remove deepspeed_config.{key}: Accelerate refuses it beside deepspeed_config_file; set it in "
        f'{path} ("auto" takes the experiment\'s value)'
        for key in DECIDED_BY_THE_FILE
        if key in launch["deepspeed_config"]
    ]
    if not path.is_file():
        # accelerate launch reads it relative to its working directory, which kanscale run shares
        return [
            *problems,
            f"deepspeed_config.deepspeed_config_file: {path} does not exist in {Path.cwd()}, the "
            "directory accelerate launch reads it from (the one kanscale run is started in); give a "
            "path relative to it, or an absolute path",
        ]
    native = read_mapping(path, "deepspeed_config.deepspeed_config_file", what="a JSON object")
    if not isinstance(native.get("zero_optimization"), dict):
        problems.append(
            f"{path} has no zero_optimization block, which Accelerate requires; add one, e.g. "
            '"zero_optimization": {"stage": 2}'
        )
    resolution = resolve_native(native, training, world_size, hidden_size(model), str(path))
    warn_unchecked(resolution, str(path))
    if resolution.problems:
        problems.append(f"deepspeed_config_file {path}: " + "; ".join(resolution.problems))
    return problems
