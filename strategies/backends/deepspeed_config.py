"""A native DeepSpeed config checked against the experiment and resolved into the config
DeepSpeed runs. Both routes to DeepSpeed use this one function, :func:`resolve_native`: the
``deepspeed`` strategy (a user's JSON with the strategy's options merged in) and the
``accelerate`` strategy's DeepSpeed plugin (the JSON its launch config names), before launch and
again inside every rank.

``"auto"``, as DeepSpeed's and Accelerate's templates use it, means "filled in by the framework".
DeepSpeed itself does not know it: 0.19 silently replaces it by its defaults, and a ZeRO-3
persistence threshold of 100,000 keeps every parameter of the study's models whole on every
rank. So the suite fills every ``"auto"`` the way Accelerate does: batch sizes, accumulation,
clipping and precision from the experiment, the bucket sizes and the persistence threshold from
the model's hidden size; an ``"auto"`` it cannot fill is refused, naming the key. The file's
``optimizer`` and ``scheduler`` blocks (and its ``fp16``/``bf16.enabled``) are the experiment's to
take in (strategies/backends/deepspeed_training.py: the suite passes its own optimizer and sets
each step's learning rate itself), so they never reach DeepSpeed.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from kan_models.base import ModelConfig
from kanscale.errors import ConfigError
from strategies.backends.deepspeed_blocks import KeyPath
from strategies.backends.deepspeed_training import BATCH_KEYS, adopt, training_keys
from strategies.sections import TrainingConfig

AUTO = "auto"

# strategy option -> its place in DeepSpeed's config (a path of keys)
OPTION_KEYS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization", "stage"),
    "offload_optimizer": ("zero_optimization", "offload_optimizer", "device"),
    "offload_param": ("zero_optimization", "offload_param", "device"),
    "overlap_comm": ("zero_optimization", "overlap_comm"),
    "contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "param_persistence_threshold": ("zero_optimization", "stage3_param_persistence_threshold"),
    "hpz_partition_size": ("zero_optimization", "zero_hpz_partition_size"),
    "quantized_weights": ("zero_optimization", "zero_quantized_weights"),
    "quantized_gradients": ("zero_optimization", "zero_quantized_gradients"),
}

# blocks read into training.* (deepspeed_training.py) and left out of what DeepSpeed is given:
# the suite passes its own optimizer object and sets every step's learning rate itself, and
# checkpoints activations itself (DeepSpeed's section acts only where a model calls its function)
TRAINING_BLOCKS = ("optimizer", "scheduler", "activation_checkpointing")
# Keys the suite fills, sets or checks, and ZeRO's scheduling knobs that decide only when and in
# what pieces state moves (DeepSpeed validates their values). Any other key may change what is
# trained or measured, so it is named in a warning.
KNOWN_TOP_LEVEL = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16",
        "bf16",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
        *TRAINING_BLOCKS,
    }
)
KNOWN_ZERO = frozenset(
    {
        "stage",
        "offload_optimizer",
        "offload_param",
        "overlap_comm",
        "contiguous_gradients",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "sub_group_size",
        "allgather_partitions",
        "reduce_scatter",
        "round_robin_gradients",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_gradients",
    }
)
# ZeRO keys DeepSpeed accepts (its aliases and older names among them) that lie close enough to
# a key above to be taken for a misspelling of it; they are passed on unchecked, like any other
# key DeepSpeed knows (tests check this list against DeepSpeed's own ZeRO config model).
OTHER_ZERO = frozenset(
    {
        "cpu_offload_param",
        "gather_16bit_weights_on_model_save",
        "max_live_parameters",
        "max_reuse_distance",
        "param_persistence_threshold",
        "prefetch_bucket_size",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_model_persistence_threshold",
    }
)
# How alike (difflib's ratio) an unknown key and a known one must be for the unknown one to be
# refused as its misspelling: zero_optimisation and stgae are; flops_profiler is not.
MISSPELLING_CUTOFF = 0.8
# "auto" values that depend on neither the experiment nor the model, as Accelerate fills them:
# the suite saves DeepSpeed checkpoints and consolidates them itself, so no 16-bit copy.
FIXED_AUTOS: dict[KeyPath, Any] = {("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): False}
# Values published files carry that this DeepSpeed refuses but whose meaning it can run, with the
# value that means the same. Transformers' ZeRO-3 test config reduces each gradient on its own with
# reduce_bucket_size 0, which DeepSpeed 0.19 refuses (it must be > 0): a bucket of one element never
# holds two gradients either.
EQUIVALENT_VALUES: dict[KeyPath, tuple[Any, Any]] = {("zero_optimization", "reduce_bucket_size"): (0, 1)}

# DeepSpeed's dynamic loss scaling set to torch.amp.GradScaler's schedule, which the other
# strategies' fp16 runs use: start at 2^16, halve on the first overflow (DeepSpeed's default
# hysteresis waits for two), double after 2000 clean steps (DeepSpeed's default: 1000).
GRAD_SCALER_SCHEDULE = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "hysteresis": 1,
    "consecutive_hysteresis": False,
    "loss_scale_window": 2000,
    "min_loss_scale": 1,
}


class UncheckedDeepSpeedKeys(UserWarning):
    """A native DeepSpeed config holds keys the suite passes to DeepSpeed without checking."""


@dataclass(frozen=True)
class Resolution:
    config: dict[str, Any]  # what DeepSpeed is given
    training: TrainingConfig  # the experiment's training with the file's optimizer, schedule and precision taken in
    problems: list[str]  # what makes the config unusable, each with its fix
    unchecked: list[str]  # dotted keys passed to DeepSpeed as they are


def hidden_size(model: ModelConfig) -> int:
    """What Accelerate calls a model's hidden size, for a KAN: its widest layer, the largest of
    ``model.widths`` (Accelerate takes the largest of a model's ``config.hidden_sizes``)."""
    return max(model.widths)


def hidden_size_values(hidden: int) -> dict[KeyPath, int]:
    """Accelerate's values for the ZeRO keys it sizes by the model (``Accelerator._prepare_deepspeed``)."""
    return {
        ("zero_optimization", "reduce_bucket_size"): hidden * hidden,
        ("zero_optimization", "stage3_prefetch_bucket_size"): int(0.9 * hidden * hidden),
        ("zero_optimization", "stage3_param_persistence_threshold"): 10 * hidden,
    }


def suite_owned_flags() -> dict[str, Any]:
    """Settings every suite-built DeepSpeed config carries: the suite's own (torch) optimizer is
    allowed under ZeRO and under offload, and DeepSpeed's periodic console output is off."""
    return {
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def get_path(tree: dict[str, Any], path: KeyPath) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def set_path(tree: dict[str, Any], path: KeyPath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def auto_paths(tree: dict[str, Any], prefix: KeyPath = ()) -> list[KeyPath]:
    """Where ``tree`` holds ``"auto"``."""
    found = []
    for key, value in tree.items():
        if isinstance(value, dict):
            found += auto_paths(value, (*prefix, key))
        elif value == AUTO:
            found.append((*prefix, key))
    return found


def unknown_keys(config: dict[str, Any]) -> list[str]:
    """Top-level and ``zero_optimization`` keys outside what the suite knows, dotted."""
    zero = config.get("zero_optimization")
    return [key for key in config if key not in KNOWN_TOP_LEVEL] + [
        f"zero_optimization.{key}" for key in (zero if isinstance(zero, dict) else {}) if key not in KNOWN_ZERO
    ]


def misspelled(dotted: str) -> str | None:
    """The known key an unknown one (dotted, as :func:`unknown_keys` names it) misspells, if any.
    DeepSpeed ignores a top-level key it does not know, so a misspelled block would silently
    fall back to its defaults."""
    section, _, key = dotted.rpartition(".")
    if section:
        known, other = KNOWN_ZERO, OTHER_ZERO
    else:
        known, other = KNOWN_TOP_LEVEL, frozenset()
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=MISSPELLING_CUTOFF)
    return f"{section + '.' if section else ''}{close[0]}" if close and key not in other else None


def nvme_offloads(config: dict[str, Any]) -> list[str]:
    """The offload blocks of ``config`` that go to NVMe (ZeRO-Infinity), dotted:
    ``zero_optimization.offload_optimizer`` and/or ``zero_optimization.offload_param``."""
    return [
        f"zero_optimization.{block}"
        for block in ("offload_optimizer", "offload_param")
        if get_path(config, ("zero_optimization", block, "device")) == "nvme"
    ]


# exit 3: DeepSpeed's async_io op (its NVMe swapper) cannot be built or loaded here
ASYNC_IO_CHECK = (
    "import sys; from deepspeed.ops.op_builder import AsyncIOBuilder; "
    "sys.exit(0 if AsyncIOBuilder().is_compatible(verbose=False) else 3)"
)


def check_async_io(config: dict[str, Any], accelerator: dict[str, str]) -> None:
    """Refuse NVMe offload in ``config`` where DeepSpeed's async_io op, which does the swapping,
    is not available on this machine: DeepSpeed finds out only when a rank builds it, after the
    launch. Asked in a process of its own with the ranks' ``accelerator`` environment, since
    DeepSpeed picks its accelerator (and so its op builders) once per process, on import."""
    blocks = nvme_offloads(config)
    if not blocks:
        return
    asked = subprocess.run(
        [sys.executable, "-c", ASYNC_IO_CHECK],
        env={**os.environ, **accelerator},
        capture_output=True,
        text=True,
        timeout=300,
    )
    devices = " and ".join(f"{block}.device" for block in blocks)
    if asked.returncode == 3:
        raise ConfigError(
            f'strategy.config: {devices} is "nvme", but DeepSpeed\'s async_io op, which swaps to NVMe, '
            "is not available on this machine (AsyncIOBuilder().is_compatible() is False: it needs libaio, "
            'e.g. apt install libaio-dev; ds_report lists the ops); install it, or set the device to "cpu"'
        )
    if asked.returncode != 0:
        why = (asked.stderr.strip().splitlines() or [f"exit code {asked.returncode}"])[-1]
        raise ConfigError(
            f'strategy.config: {devices} is "nvme", and whether DeepSpeed\'s async_io op is available '
            f'here could not be found out ({why}); set the device to "cpu", or fix the installation'
        )


def as_json(value: Any) -> str:
    return json.dumps(value)


def resolve_native(
    native: dict[str, Any], training: TrainingConfig, world_size: int, hidden: int, source: str
) -> Resolution:
    """``native`` (not changed) checked and resolved for this experiment at ``world_size`` ranks,
    with a model of hidden size ``hidden``; ``source`` names the file in the advice."""
    adoption = adopt(native, training, source)
    training = adoption.training
    config = {key: value for key, value in copy.deepcopy(native).items() if key not in TRAINING_BLOCKS}
    problems = list(adoption.problems)
    for path, (value, origin, fix) in training_keys(training, world_size).items():
        given = get_path(config, path)
        if given not in (None, AUTO) and given != value and path[0] not in BATCH_KEYS:  # adopt named those
            resolving = fix(given)
            problems.append(
                f"{'.'.join(path)}={as_json(given)}, but {origin} implies {as_json(value)}: set it to "
                f'{as_json(value)} or "auto" in {source}' + (f", or {resolving}" if resolving else "")
            )
        set_path(config, path, value)
    if training.precision == "fp16":
        for key, value in GRAD_SCALER_SCHEDULE.items():  # where the file leaves them open
            if get_path(config, ("fp16", key)) in (None, AUTO):
                set_path(config, ("fp16", key), value)
    for path, value in {**hidden_size_values(hidden), **FIXED_AUTOS}.items():
        if get_path(config, path) == AUTO:
            set_path(config, path, value)
    for path, (refused, same) in EQUIVALENT_VALUES.items():
        if get_path(config, path) == refused:
            set_path(config, path, same)
    unresolved = [".".join(path) for path in auto_paths(config)]
    if unresolved:
        problems.append(
            f'the suite cannot fill "auto" for {", ".join(unresolved)}; give a value in {source} '
            '("auto" is filled for batch sizes, accumulation, clipping, fp16/bf16.enabled, '
            "reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold and "
            "stage3_gather_16bit_weights_on_model_save)"
        )
    # DeepSpeed asserts this inside every rank, after the launch
    problems += [
        f'{block}.device is "nvme" but {block}.nvme_path is not set (DeepSpeed needs the directory it swaps '
        f"to): give {block}.nvme_path, a directory on a local NVMe drive, in {source}, or set {block}.device "
        'to "cpu"'
        for block in nvme_offloads(config)
        if not get_path(config, (*block.split("."), "nvme_path"))
    ]
    unknown = unknown_keys(native)
    fixes = {key: spelling for key in unknown if (spelling := misspelled(key))}
    problems += [
        f"{key} is not a DeepSpeed key; did you mean {fix}? (rename it in {source})" for key, fix in fixes.items()
    ]
    if not problems:
        problems += zero_values_refused(config, source)
    config.update(suite_owned_flags())
    return Resolution(config, training, problems, [key for key in unknown if key not in fixes])


def zero_values_refused(config: dict[str, Any], source: str) -> list[str]:
    """The ``zero_optimization`` values DeepSpeed's own config model refuses, each named by its full
    key: checked here, before launch, rather than by ``deepspeed.initialize`` inside every rank."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # DeepSpeed's own rules, not a copy of them
    from pydantic import ValidationError

    try:
        with warnings.catch_warnings():  # its deprecation notices are DeepSpeed's to give, inside the ranks
            warnings.simplefilter("ignore")
            DeepSpeedZeroConfig(**zero)
    except ValidationError as err:
        return [
            f"zero_optimization.{'.'.join(str(part) for part in error['loc'])} is {as_json(error.get('input'))} "
            f"in {source}, which DeepSpeed refuses: {error['msg']}; change it in {source}"
            for error in err.errors()
        ]
    return []


def warn_unchecked(resolution: Resolution, source: str) -> None:
    """One warning naming the keys passed to DeepSpeed unchecked. Every launcher exports RANK:
    the launch check (no RANK) and rank 0 report them, the other ranks would only repeat it."""
    if resolution.unchecked and os.environ.get("RANK", "0") == "0":
        warnings.warn(
            f"{source}: the suite does not know {', '.join(resolution.unchecked)}; they are passed to "
            "DeepSpeed unchecked",
            UncheckedDeepSpeedKeys,
            stacklevel=1,
        )  # from this line: shown once per process
