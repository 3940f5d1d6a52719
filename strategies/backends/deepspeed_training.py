"""What a native DeepSpeed file says about the training itself, taken into the experiment.

DeepSpeed's and Transformers' templates carry ``optimizer``, ``scheduler``, ``fp16`` and ``bf16``
blocks, and DeepSpeed's examples fixed batch sizes, accumulation and clipping. The suite passes
its own optimizer to DeepSpeed and sets the learning rate of every step itself
(strategies/step/schedule.py), so these blocks never reach DeepSpeed; they are read into
``training.*`` instead, as Transformers' Trainer and Accelerate read them:

- ``"auto"`` (or a key left out) is filled from the experiment;
- a concrete value is adopted where the experiment did not set that field (pydantic's
  ``model_fields_set``: the YAML or ``--set`` named it), and recorded, field by field, with the
  file and key it came from (the run record's ``strategy.adopted``);
- where the experiment set the field to another value, the run is refused naming every such
  difference at once, with the ``--set`` lines that take the file's values, the file edit that
  keeps the experiment's, and ``strategy.decides`` (file or experiment), one line for all.

An ``activation_checkpointing`` section is read as ``training.activation_checkpointing: layers``
(DeepSpeed would act on it only where the model called its checkpoint function), refused where
it asks to partition, offload or pack activations, which the suite does not do.

The file's ``fp16``/``bf16.enabled`` adopted into ``training.precision`` the same way; a
contradiction with a precision the experiment set is :func:`resolve_native`'s to refuse, as
before. :func:`adopt` is deterministic and gives the same training for an experiment already
adopted, so every place that resolves the file (before launch, in every rank) agrees.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kanscale.errors import ConfigError
from strategies.backends.deepspeed_blocks import KeyPath
from strategies.sections import TrainingConfig

AUTO = "auto"
FieldPath = tuple[str, ...]  # inside training: ("lr",), ("schedule", "warmup_steps")

# DeepSpeed's optimizer types the suite builds (DeepSpeed compares them lower-cased): Adam is
# AdamW unless adam_w_mode is false (DeepSpeed's ADAM_W_MODE_DEFAULT), AdamW always.
ADAM_TYPES = {"adam", "adamw"}
OPTIMIZER_PARAMS: dict[str, FieldPath] = {
    "lr": ("lr",),
    "betas": ("betas",),
    "eps": ("eps",),
    "weight_decay": ("weight_decay",),
}
# params that choose DeepSpeed's implementation of the same update (torch's, its fused or CPU
# Adam), which the suite's torch optimizer computes: read (adam_w_mode) or accepted as they are
IMPLEMENTATION_PARAMS = {"torch_adam": None, "adam_w_mode": None, "bias_correction": True}
# scheduler type -> training.schedule.name, and the params each takes (DeepSpeed's constructors)
SCHEDULERS = {"warmuplr": "warmup", "warmupdecaylr": "warmup_decay", "warmupcosinelr": "warmup_cosine"}
SCHEDULER_PARAMS: dict[str, FieldPath] = {
    "warmup_min_lr": ("schedule", "warmup_min_lr"),
    "warmup_max_lr": ("lr",),
    "warmup_num_steps": ("schedule", "warmup_steps"),
    "warmup_type": ("schedule", "warmup_type"),
    "total_num_steps": ("schedule", "total_steps"),
    "warmup_min_ratio": ("schedule", "warmup_min_ratio"),
    "cos_min_ratio": ("schedule", "cos_min_ratio"),
}
# The batch and clipping keys a rank's own share decides, taken in as the blocks are (so that one
# refusal names them beside the optimizer's); train_batch_size, which the rank count decides
# too, is checked once the launch's size is known (deepspeed_config.resolve_native).
BATCH_KEYS: dict[str, FieldPath] = {
    "train_micro_batch_size_per_gpu": ("micro_batch",),
    "gradient_accumulation_steps": ("grad_accum",),
    "gradient_clipping": ("grad_clip",),
}
# DeepSpeed's activation_checkpointing options beyond recomputing layers, which the suite lacks
CHECKPOINTING_BEYOND = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)
BATCH_SIZE_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
BATCH_FIELDS = ("micro_batch", "grad_accum", "global_batch")
TAKES = {
    "warmup": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "warmup_decay": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
    "warmup_cosine": {"warmup_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps", "cos_min_ratio"},
}


@dataclass(frozen=True)
class Adoption:
    training: TrainingConfig  # the experiment's training with the file's values taken in
    adopted: dict[str, str]  # training field (dotted) -> the file and key it came from, with the value
    problems: list[str]  # each names the file's key and the fix


def set_line(field: str, value: Any) -> str:
    """The ``--set`` option that gives ``training.<field>`` ``value``, as the command line parses it."""
    text = f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)
    return f"--set training.{field}={text}"


def is_set(training: TrainingConfig, path: FieldPath) -> bool:
    """Whether the experiment (its YAML or ``--set``) gave this training field."""
    node: Any = training
    for key in path:
        if key not in node.model_fields_set:
            return False
        node = getattr(node, key)
    return True


def current(training: TrainingConfig, path: FieldPath) -> Any:
    node: Any = training
    for key in path:
        node = getattr(node, key)
    return list(node) if isinstance(node, tuple) else node


def wanted_values(native: dict[str, Any], source: str) -> tuple[dict[FieldPath, tuple[Any, str]], list[str]]:
    """The training values ``native`` states (field -> (value, its dotted key)), and what in its
    optimizer and scheduler blocks the suite cannot build."""
    wanted: dict[FieldPath, tuple[Any, str]] = {}
    problems: list[str] = []

    def want(path: FieldPath, value: Any, key: str) -> None:
        if value is None or value == AUTO:
            return
        if path not in wanted:
            wanted[path] = (value, key)
        elif not same(wanted[path][0], value):
            problems.append(
                f"{wanted[path][1]} is {value_text(wanted[path][0])} but {key} is {value_text(value)}, and "
                f"both are training.{'.'.join(path)} here; make them equal in {source}"
            )

    for key, path in BATCH_KEYS.items():
        want(path, native.get(key), key)
    optimizer = native.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.get("params") or {}
        kind = str(optimizer.get("type", AUTO)).lower()
        if kind in ADAM_TYPES:
            w_mode = kind == "adamw" or params.get("adam_w_mode", True) is not False
            want(("optimizer",), "adamw" if w_mode else "adam", "optimizer.type")  # the key's value is named as written
        elif kind != AUTO:
            problems.append(
                f"optimizer.type is {optimizer.get('type')!r}, which the suite does not build (it "
                'trains with torch\'s Adam, AdamW or SGD); set optimizer.type to "AdamW" or "Adam", or '
                "remove the optimizer block and set training.optimizer"
            )
        for key, value in params.items():
            if key in OPTIMIZER_PARAMS:
                want(OPTIMIZER_PARAMS[key], value, f"optimizer.params.{key}")
            elif key not in IMPLEMENTATION_PARAMS or IMPLEMENTATION_PARAMS[key] not in (None, value):
                problems.append(
                    f"optimizer.params.{key} is not among what the suite's optimizer takes "
                    f"({', '.join(OPTIMIZER_PARAMS)}; torch_adam, adam_w_mode and bias_correction: true "
                    f"choose DeepSpeed's implementation of the same update); remove it from {source}"
                )
    checkpointing = native.get("activation_checkpointing")
    if isinstance(checkpointing, dict):
        # DeepSpeed's section acts only where a model calls deepspeed.checkpointing.checkpoint; the
        # suite's own checkpointing of every layer is what it asks for, as far as it goes
        beyond = [k for k in CHECKPOINTING_BEYOND if checkpointing.get(k) not in (None, False)]
        if beyond:
            problems.append(
                f"activation_checkpointing.{', activation_checkpointing.'.join(beyond)}: the suite checkpoints "
                "activations by recomputing each layer (training.activation_checkpointing: layers) and does not "
                f"partition, offload or pack them; remove {', '.join(beyond)} from {source}"
            )
        else:
            want(("activation_checkpointing",), "layers", "activation_checkpointing")
    scheduler = native.get("scheduler")
    if isinstance(scheduler, dict):
        params = scheduler.get("params") or {}
        name = SCHEDULERS.get(str(scheduler.get("type", "")).lower())
        if name is None:
            problems.append(
                f"scheduler.type is {scheduler.get('type')!r}; the suite runs DeepSpeed's "
                "WarmupLR, WarmupDecayLR and WarmupCosineLR (training.schedule); use one of them, or remove "
                "the scheduler block and set training.schedule"
            )
            return wanted, problems
        want(("schedule", "name"), name, "scheduler.type")
        for key, value in params.items():
            if key == "last_batch_iteration" and value in (-1, AUTO):
                continue  # DeepSpeed's default: start the schedule at the start (a resume continues it by step)
            if key not in TAKES[name]:
                problems.append(
                    f"scheduler.params.{key}: {scheduler['type']} takes no {key} here (it takes "
                    f"{', '.join(sorted(TAKES[name]))}); remove it from {source}"
                )
                continue
            want(SCHEDULER_PARAMS[key], value, f"scheduler.params.{key}")
    return wanted, problems


def shown(native: dict[str, Any], key: str, value: Any) -> str:
    """A file's value as the file writes it (optimizer.type "AdamW", not the adamw it maps to)."""
    written: Any = native
    for part in key.split("."):
        written = written.get(part) if isinstance(written, dict) else None
    return json.dumps(written) if written is not None else value_text(value)


def value_text(value: Any) -> str:
    return f"[{', '.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def adopt(native: dict[str, Any], training: TrainingConfig, source: str) -> Adoption:
    """``training`` with what ``native`` (the DeepSpeed file named ``source``) states of the
    optimizer, the schedule and the precision taken in where the experiment left it open."""
    wanted, problems = wanted_values(native, source)
    precision = [kind for kind in ("fp16", "bf16") if (native.get(kind) or {}).get("enabled") is True]
    if len(precision) > 1:
        problems.append(f"fp16.enabled and bf16.enabled are both true; enable one of them in {source}")
    elif precision:
        # a set precision that contradicts it: resolve_native
        wanted[("precision",)] = (precision[0], f"{precision[0]}.enabled")
    data = training.model_dump(exclude_unset=True)
    adopted: dict[str, str] = {}
    conflicts: dict[str, str] = {}  # the file's key -> the --set line that takes its value
    for path, (value, key) in wanted.items():
        field = ".".join(path)
        if is_set(training, path):
            given = current(training, path)
            if path != ("precision",) and not same(given, value):
                problems.append(
                    f"{key} is {shown(native, key, value)}, but the experiment sets training.{field} to "
                    f"{value_text(given)}"
                )
                conflicts[key] = set_line(field, value)
            continue
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        adopted[f"training.{field}"] = f"{source}: {key} = {shown(native, key, value)}"
    if conflicts:
        problems.append(
            f"to train with the file's values: {' '.join(conflicts.values())}; to keep the experiment's: set "
            f'{", ".join(conflicts)} to "auto" in {source}'
        )
    try:
        result = TrainingConfig.model_validate(data)
    except ValidationError as err:
        for error in err.errors():
            path = tuple(str(p) for p in error["loc"])
            file_key = next(
                (k for p, (_, k) in wanted.items() if path[: len(p)] == p and f"training.{'.'.join(p)}" in adopted),
                None,
            )
            where = file_key or (f"training.{'.'.join(path)}" if path else "the optimizer and scheduler blocks")
            problems.append(
                f"{where}: {error['msg'].removeprefix('Value error, ')} (given: {error.get('input')!r}); "
                f"give a value the suite takes in {source}"
            )
        return Adoption(training, {}, problems)
    return Adoption(result, adopted, problems)


DECIDES_ADVICE = (
    "; or one line for every difference: --set strategy.decides=file takes every value the file states, "
    "--set strategy.decides=experiment keeps the experiment's"
)


def with_decides_advice(problems: list[str]) -> list[str]:
    """A DeepSpeed strategy's problems, with the one line that settles every difference between
    its file and the experiment where there is one (the Accelerate plugin's route has no such option)."""
    differ = any("to train with the file's values" in p or ", but training." in p for p in problems)
    return [*problems[:-1], problems[-1] + DECIDES_ADVICE] if differ else problems


# what the experiment decides under ``strategy.decides: experiment``: the keys a file states of
# the training, left out (the precision's switches left open, the blocks' other keys kept)
TRAINING_OWNED = ("optimizer", "scheduler", "gradient_clipping", *BATCH_SIZE_KEYS)


def decided(native: dict[str, Any], training: TrainingConfig, decides: str) -> tuple[dict, TrainingConfig]:
    """The file and the experiment as ``strategy.decides`` has them agree. ``file``: every
    training field the file states counts as left open in the experiment, so the file's values
    are taken in (and recorded as adopted; its train_batch_size is then checked against the
    launch's ranks); ``experiment``: the file's statements of the training are left out, so the
    experiment's fill them; ``check``: both as given, a difference refused with both fixes."""
    if decides == "experiment":
        kept = {key: value for key, value in native.items() if key not in TRAINING_OWNED}
        for block in ("fp16", "bf16"):
            if isinstance(kept.get(block), dict) and "enabled" in kept[block]:
                kept[block] = {**kept[block], "enabled": AUTO}
        return kept, training
    if decides == "file":
        wanted, _ = wanted_values(native, "")
        stated = {path[0] for path in wanted}
        if any(native.get(key) not in (None, AUTO) for key in BATCH_SIZE_KEYS):
            stated |= set(BATCH_FIELDS)
        if any((native.get(block) or {}).get("enabled") is True for block in ("fp16", "bf16")):
            stated.add("precision")
        open_fields = training.model_copy()
        open_fields.__pydantic_fields_set__ = training.model_fields_set - stated
        return native, open_fields
    return native, training


def same(given: Any, value: Any) -> bool:
    """Whether the experiment's value and the file's are the same setting (numbers compared as numbers)."""
    if isinstance(given, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(given) == len(value) and all(same(a, b) for a, b in zip(given, value, strict=True))
    if isinstance(given, (int, float)) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(given) == float(value)
    return given == value


def adopted_training(
    native: dict[str, Any], source: str, training: TrainingConfig, offer_decides: bool = False
) -> TrainingConfig:
    """:func:`adopt`'s training, remembering what it took (``_adopted``, for the run record); a
    ConfigError names every problem (``offer_decides``: and the strategy's one line for them)."""
    adoption = adopt(native, training, source)
    if adoption.problems:
        problems = with_decides_advice(adoption.problems) if offer_decides else adoption.problems
        raise ConfigError(f"strategy.config: {source} cannot run as given: " + "; ".join(problems))
    result = adoption.training
    result._adopted = adoption.adopted
    return result


def training_keys(
    training: TrainingConfig, world_size: int
) -> dict[KeyPath, tuple[Any, str, Callable[[Any], str | None]]]:
    """DeepSpeed keys whose values the experiment owns, each with the experiment keys it comes from
    and the ``--set`` line that would make the experiment say what the file says (None: no one line)."""
    micro = training.micro_batch_for(world_size)
    by_micro = training.micro_batch is not None
    per_rank = "training.micro_batch" if by_micro else "training.global_batch"
    precision = f"training.precision={training.precision}"
    return {
        ("train_micro_batch_size_per_gpu",): (
            micro,
            per_rank,
            lambda v: set_line("micro_batch", v) if by_micro else None,
        ),
        ("gradient_accumulation_steps",): (
            training.grad_accum,
            "training.grad_accum",
            lambda v: set_line("grad_accum", v),
        ),
        ("train_batch_size",): (
            micro * training.grad_accum * world_size,
            f"{per_rank} x training.grad_accum x {world_size} ranks",
            lambda v: set_line("global_batch", v) if not by_micro else _ranks_for(v, micro * training.grad_accum),
        ),
        ("gradient_clipping",): (training.grad_clip, "training.grad_clip", lambda v: set_line("grad_clip", v)),
        ("fp16", "enabled"): (
            training.precision == "fp16",
            precision,
            lambda v: set_line("precision", "fp16" if v is True else "fp32"),
        ),
        ("bf16", "enabled"): (
            training.precision == "bf16",
            precision,
            lambda v: set_line("precision", "bf16" if v is True else "fp32"),
        ),
    }


def _ranks_for(batch: Any, per_rank: int) -> str | None:
    """The launch that makes a file's ``train_batch_size`` what the experiment trains, if any."""
    if isinstance(batch, int) and batch > 0 and batch % per_rank == 0:
        return f"launch {batch // per_rank} data-parallel rank(s) (micro-batch x accumulation = {per_rank} each)"
    return None
