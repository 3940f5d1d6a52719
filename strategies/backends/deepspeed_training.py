"""What a native DeepSpeed file says about the training itself, taken into the experiment.

DeepSpeed's and Transformers' templates carry ``optimizer``, ``scheduler``, ``fp16`` and ``bf16``
blocks. The suite passes its own optimizer to DeepSpeed and sets the learning rate of every step
itself (strategies/schedule.py), so these blocks never reach DeepSpeed; they are read into
``training.*`` instead, as Transformers' Trainer and Accelerate read them:

- ``"auto"`` (or a key left out) is filled from the experiment;
- a concrete value is adopted where the experiment did not set that field (pydantic's
  ``model_fields_set``: the YAML or ``--set`` named it), and recorded, field by field, with the
  file and key it came from (the run record's ``strategy.adopted``);
- where the experiment set the field to another value, the run is refused naming both sides and
  the ``--set`` line that takes the file's value.

The file's ``fp16``/``bf16.enabled`` adopted into ``training.precision`` the same way; a
contradiction with a precision the experiment set is :func:`resolve_native`'s to refuse, as
before. :func:`adopt` is deterministic and gives the same training for an experiment already
adopted, so every place that resolves the file (before launch, in every rank) agrees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kanscale.errors import ConfigError
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


def same(given: Any, value: Any) -> bool:
    """Whether the experiment's value and the file's are the same setting (numbers compared as numbers)."""
    if isinstance(given, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(given) == len(value) and all(same(a, b) for a, b in zip(given, value, strict=True))
    if isinstance(given, (int, float)) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(given) == float(value)
    return given == value


def adopted_training(native: dict[str, Any], source: str, training: TrainingConfig) -> TrainingConfig:
    """:func:`adopt`'s training, remembering what it took (``_adopted``, for the run record); a
    ConfigError names every problem."""
    adoption = adopt(native, training, source)
    if adoption.problems:
        raise ConfigError(f"strategy.config: {source} cannot run as given: " + "; ".join(adoption.problems))
    result = adoption.training
    result._adopted = adoption.adopted
    return result
