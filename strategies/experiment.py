"""The experiment config: one YAML file holding the model, the task, every training
hyperparameter, the strategy and where results go, validated into typed objects.

Loading goes YAML -> dict -> ``--set`` overrides -> pydantic validation. Every problem is
reported as a :class:`ConfigError` naming the field, what was given and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import os
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from kan_models import AnyModelConfig, AnyTaskConfig
from kan_models.base import ModelConfig
from kan_models.custom import CustomConfig
from kan_models.registry import FAMILIES
from kan_models.tasks import TASKS
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import find_file, find_preset, parse_yaml_value, read_mapping
from kanscale.identity import digest, identity
from strategies.registry import AnyStrategyConfig
from strategies.sections import (
    FaultConfig,
    MeasurementConfig,
    OutputConfig,
    RuntimeConfig,
    Section,
    TrackingConfig,
    TrainingConfig,
)
from strategies.strategy import StrategyConfig

logger = log.get(__name__)


class ExperimentConfig(Section):
    name: str = Field(
        min_length=1,
        max_length=200,  # a run's folder is named by it, and a file system holds 255 bytes per name
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="used in run ids",
    )
    study: str | None = Field(None, description="the study (sweep) this run belongs to")
    model: AnyModelConfig
    task: AnyTaskConfig
    training: TrainingConfig = TrainingConfig()
    strategy: AnyStrategyConfig = Field(default_factory=lambda: {"name": "single"}, validate_default=True)
    measurement: MeasurementConfig = MeasurementConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    output: OutputConfig = OutputConfig()
    tracking: TrackingConfig = TrackingConfig()
    fault: FaultConfig | None = Field(None, description="fault injection, for testing failure handling")

    @model_validator(mode="before")
    @classmethod
    def _compile_moved_to_training(cls, data: Any) -> Any:
        """``model.compile: true``, the spelling before ``training.compile`` (config.yaml of older
        runs has it), reads as ``training.compile: model``."""
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or "compile" not in model:
            return data
        model = dict(model)
        if model.pop("compile") is True:
            training = dict(data.get("training") or {})
            if training.setdefault("compile", "model") != "model":
                raise ValueError(
                    f"model.compile: true contradicts training.compile: {training['compile']}; "
                    "drop model.compile (training.compile says what is compiled)"
                )
            data = {**data, "training": training}
        return {**data, "model": model}

    @model_validator(mode="after")
    def _model_fits_task(self) -> ExperimentConfig:
        widths, task = self.model.widths, self.task
        # both ends in one message: a new file's user learns the whole fix from one run
        wrong = []
        if widths[0] != task.input_dim:
            wrong.append(f"starts with {widths[0]} inputs but task {task.name} has {task.input_dim}")
        if widths[-1] != task.output_dim:
            wrong.append(f"ends with {widths[-1]} outputs but task {task.name} has {task.output_dim}")
        if wrong:
            fixed = ",".join(str(w) for w in [task.input_dim, *widths[1:-1], task.output_dim])
            raise ValueError(f"model.widths {' and '.join(wrong)}; set model.widths=[{fixed}]")
        return self

    @model_validator(mode="after")
    def _strategy_as_it_runs(self) -> ExperimentConfig:
        # A native backend file may decide options the strategy section leaves out (the zero3
        # preset's stage lives in its DeepSpeed JSON, an "auto" bucket size is sized by the
        # model); fill them in, so that config.yaml and the run record say what runs.
        self.strategy = self.strategy.resolved(self.model)
        return self

    def resolved(self) -> dict[str, Any]:
        """Every field, defaults filled in: what a run used, written as its config.yaml."""
        return self.model_dump(mode="json")

    def identity(self) -> dict[str, Any]:
        """The resolved config less what does not make the experiment what it is (kanscale/identity.py)."""
        return identity(self.resolved())

    def digest(self) -> str:
        """Hash of :meth:`identity`; equal digests mean equal experiments."""
        return digest(self.identity())


# ----------------------------------------------------------------------------------------
# Loading

STRATEGY_SECTION = TypeAdapter(AnyStrategyConfig)


def load_experiment(
    path: str | Path,
    overrides: Sequence[str] = (),
    strategy: str | None = None,
    settings: Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """Read a YAML experiment (a file, or the name of a shipped one such as ``quickstart``), swap
    in a strategy preset if one is named, apply ``key.path=value`` overrides, then ``settings``
    (``{"output.dir": "runs/a#b"}``: values taken as given, never read as YAML), validate."""
    path = experiment_path(path)
    data = read_sections(path)
    if strategy is not None:
        data["strategy"] = read_sections(find_preset(strategy, "strategies", "--strategy"))
    return parse_experiment(data, overrides, source=str(path), settings=settings)


def load_strategy(preset: str, model: ModelConfig, field: str = "--strategy") -> StrategyConfig:
    """A strategy preset alone (a shipped name such as ``zero3``, or a YAML file of the user's own)
    validated and resolved for ``model``, as an experiment naming it would run it."""
    data = read_sections(find_preset(preset, "strategies", field))
    try:
        strategy = STRATEGY_SECTION.validate_python(data)
    except ValidationError as err:
        lines = [describe_error({**e, "loc": ("strategy", *e["loc"])}, {"strategy": data}) for e in err.errors()]
        raise ConfigError(f"{field}: {preset} is invalid:\n" + error_lines(lines)) from None
    return strategy.resolved(model)


def experiment_path(name: str | Path) -> Path:
    """An experiment file as given; a bare name that is no file is a shipped experiment preset."""
    path = Path(name)
    try:
        given = path.exists()
    except OSError:  # a name no file could have (too long): not given, so a preset's name to look up
        given = False
    if given:
        return path
    if path.suffix or len(path.parts) > 1:
        return find_file(str(name), "config", "experiment file")
    return find_preset(str(name), "experiments", "config")


def read_sections(path: str | Path) -> dict[str, Any]:
    """A YAML config file holding a mapping of sections."""
    return read_mapping(path, what="a mapping of sections (model, task, training, ...)")


# The sections whose class one of their keys chooses: the model's family, the task's name.
SWITCHES: dict[str, tuple[str, Mapping[str, type[BaseModel]]]] = {
    "model": ("family", {**FAMILIES, "custom": CustomConfig}),
    "task": ("name", TASKS),
}


def parse_experiment(
    data: dict[str, Any],
    overrides: Sequence[str] = (),
    source: str = "config",
    settings: Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    written = copy.deepcopy(data)
    for override in overrides:
        apply_override(data, override)
    for key, value in (settings or {}).items():
        set_field(data, key, value, key)
    drop_switched_keys(written, data, overrides)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            f"{source} is invalid:\n" + error_lines([describe_error(e, data) for e in err.errors()])
        ) from None


def drop_switched_keys(written: dict[str, Any], data: dict[str, Any], overrides: Sequence[str]) -> None:
    """Where ``--set model.family=...`` (or ``task.name=...``) switched a section to another class,
    drop from ``data`` the keys the file wrote for the old class that the new one does not have
    (``grid`` and ``k`` of a bspline model switched to chebyshev), with a one-line note. A key the
    old class does not know either (a misspelling) stays, to be refused; so does anything set on
    the command line."""
    for section, (key, classes) in SWITCHES.items():
        before, after = written.get(section), data.get(section)
        if not (isinstance(before, dict) and isinstance(after, dict)):
            continue
        old, new = classes.get(str(before.get(key))), classes.get(str(after.get(key)))
        if old is None or new is None or old is new:
            continue
        typed = {
            o.partition("=")[0].strip().split(".")[1]
            for o in overrides
            if o.partition("=")[0].strip().startswith(f"{section}.") and "." in o.partition("=")[0]
        }
        dropped = [
            k for k in before if k in after and k not in typed and k in old.model_fields and k not in new.model_fields
        ]
        for k in dropped:
            del after[k]
        if dropped and os.environ.get("RANK", "0") == "0":  # once per launch, not from every rank
            logger.info(
                f"kanscale: note: --set {section}.{key}={after[key]}: left out {', '.join(dropped)} of the file's "
                f"{before[key]} {section}, which {after[key]} does not take"
            )


def apply_override(data: dict[str, Any], override: str) -> None:
    """``training.lr=0.01`` sets data['training']['lr'] = 0.01; the value is parsed as YAML, so
    ``model.widths=[2,32,1]`` and ``runtime.threads=null`` work."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected key.path=value, e.g. --set training.lr=0.01")
    set_field(data, key, parse_yaml_value(raw, f"--set {override!r}"), f"--set {override!r}")


def set_field(data: dict[str, Any], key: str, value: Any, field: str) -> None:
    """data[a][b] = value for ``key`` ``a.b``, the sections made where missing."""
    node = data
    parts = key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{field}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def describe_error(error: Mapping[str, Any], data: dict[str, Any], root: type[BaseModel] | None = None) -> str:
    """One line for one pydantic error: the field path, what was given, what is allowed.
    ``root`` is the class ``data`` was validated into (default: the experiment)."""
    path = _field_path(error["loc"], data)
    kind, msg, given = error["type"], error["msg"], error.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(error["loc"], data, root or ExperimentConfig)
        close = difflib.get_close_matches(str(error["loc"][-1]), allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{path}: unknown key; {hint}allowed keys here: {', '.join(allowed)}"
    if kind == "union_tag_invalid":
        ctx = error["ctx"]
        return f"{path}.{ctx['discriminator'].strip(chr(39))}: {ctx['tag']!r} is not one of {ctx['expected_tags']}"
    if kind == "union_tag_not_found":
        return f"{path}: missing '{error['ctx']['discriminator'].strip(chr(39))}' (which kind to use)"
    if kind == "missing":
        return f"{path}: required field is missing"
    msg = msg.removeprefix("Value error, ").removeprefix(f"{path}: ")  # a validator's own message may name the field
    shown = "" if isinstance(given, dict) else f" (given: {short_repr(given)})"
    return f"{path}: {msg}{shown}" if path else f"{msg}{shown}"


# A value in a message is cut short, and so is the list of errors: a YAML alias bomb (anchors
# nested nine deep) is a few lines of text that expands to 10^8 values.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 2, 4, 4, 4, 4
_SHORT.maxstring, _SHORT.maxother = 80, 80
MAX_ERROR_LINES, MAX_LINE = 20, 500


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a line, in time independent of the value's size."""
    return _SHORT.repr(value)


def error_lines(lines: list[str]) -> str:
    """A message's list of problems: the first MAX_ERROR_LINES, each cut to MAX_LINE characters."""
    shown = [line if len(line) <= MAX_LINE else line[:MAX_LINE] + "..." for line in lines[:MAX_ERROR_LINES]]
    more = [f"... and {len(lines) - MAX_ERROR_LINES} more"] if len(lines) > MAX_ERROR_LINES else []
    return "\n".join(f"  - {line}" for line in shown + more)


def _field_path(loc: tuple, data: dict[str, Any]) -> str:
    """Join a pydantic error location into ``a.b.c``, dropping the union-tag entries pydantic
    inserts (``model.bspline.grid`` -> ``model.grid``)."""
    parts: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(node, dict) and part not in node and isinstance(part, str) and _is_tag(node, part):
            continue
        parts.append(f"[{part}]" if isinstance(part, int) else str(part))
        node = (
            node.get(part)
            if isinstance(node, dict)
            else (node[part] if isinstance(node, list) and isinstance(part, int) and part < len(node) else None)
        )
    return ".".join(parts).replace(".[", "[")


def _is_tag(node: dict[str, Any], part: str) -> bool:
    return any(node.get(key) == part for key in ("family", "name"))


def _allowed_keys(loc: tuple, data: dict[str, Any], root: type[BaseModel]) -> list[str]:
    """The fields of the config class that rejected an unknown key at ``loc``."""
    cls: Any = root
    node: Any = data
    for part in loc[:-1]:
        if isinstance(node, dict) and part not in node and _is_tag(node, part):
            continue
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        node = node.get(part) if isinstance(node, dict) else None
        cls = _resolve_class(field.annotation if field else None, node)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return list(cls.model_fields)
    return []


def _resolve_class(annotation: Any, node: Any) -> Any:
    """The BaseModel class a field's value is validated into (following discriminated unions)."""
    candidates = [annotation]
    while candidates:
        current = candidates.pop()
        if isinstance(current, type) and issubclass(current, BaseModel):
            tag_fields = [f for f in ("family", "name") if f in current.model_fields]
            if not tag_fields or not isinstance(node, dict):
                return current
            tag = current.model_fields[tag_fields[0]].annotation
            if node.get(tag_fields[0]) in get_args(tag):
                return current
            continue
        candidates.extend(get_args(current))
    return None


def dump_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
