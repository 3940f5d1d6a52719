"""Studies: a base experiment plus a matrix of axes, expanded into the points of a sweep.

    study: strong                 # what the analysis groups by
    preset: cpu
    experiment: configs/experiments/paper_kan64.yaml
    launcher: torchrun            # accelerate presets are always started by accelerate launch
    slurm: {device: cuda, inner: torchrun, time: "01:00:00"}   # launcher: slurm only
    set: {training.epochs: 1}     # overrides for every point
    per_rank: {task.n_train: 4096}  # multiplied by the point's world size (weak scaling)
    matrix:
      strategy: [ddp, fsdp2, zero3]   # presets from configs/strategies/
      topology: [1x1, 1x2]            # nodes x ranks per node
      model.widths: [[2, 32, 1], [2, 64, 1]]   # any other key is a config path
      size:                           # a value may be a bundle of overrides (and a label)
        - {label: small, model.widths: [2, 64, 1]}
        - {label: wide, model.widths: [256, 1024, 1], task.name: high_dim, task.dim: 256}
    include:                          # extra points, outside the product
      - {strategy: single, topology: 1x1}
    repeats: 3                        # run every point this many times (analysis shows median, min-max)

The points are the matrix's cartesian product, then ``include``; a strategy that runs without a
process group (``single``) pairs only with one rank (other pairings are listed as not run).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from kan_models.base import NumbersNotBooleans
from kanscale.errors import ConfigError
from kanscale.files import find_file, find_preset
from launchers.launch.slurm import SlurmOptions
from strategies.experiment import describe_error, read_sections
from strategies.registry import AnyStrategyConfig
from strategies.strategy import StrategyConfig

TOPOLOGY = re.compile(r"^(\d+)x(\d+)$")
STRATEGY = TypeAdapter(AnyStrategyConfig)


class StudyConfig(NumbersNotBooleans):  # repeats: true is not 1 run
    model_config = ConfigDict(extra="forbid")

    study: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    preset: str = Field("custom", description="paper | cpu | ...")
    description: str = ""
    experiment: str = Field(description="the base experiment YAML")
    launcher: Literal["torchrun", "deepspeed", "slurm"] = "torchrun"
    set: dict[str, Any] = Field(default_factory=dict)
    per_rank: dict[str, int] = Field(default_factory=dict)
    matrix: dict[str, list[Any]]
    include: list[dict[str, Any]] = Field(default_factory=list)
    repeats: int = Field(1, ge=1, description="runs of every point")
    slurm: SlurmOptions = SlurmOptions()

    @field_validator("matrix")
    @classmethod
    def _axes(cls, matrix: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not matrix or any(not values for values in matrix.values()):
            raise ValueError("needs at least one axis, each with at least one value")
        for axis, values in matrix.items():
            check_distinct(axis, values)
        check_axis_values(matrix)
        return matrix

    @field_validator("include")
    @classmethod
    def _included(cls, include: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for point in include:
            check_axis_values({k: [v] for k, v in point.items()})
        return include

    @model_validator(mode="after")
    def _include_is_new(self) -> StudyConfig:
        seen = {frozenset(key_parts(point)) for point in self.combinations()}
        for i, point in enumerate(self.include):
            if frozenset(key_parts(point)) in seen:
                raise ValueError(
                    f"include[{i}] ({point_key(point)}) is already a point of the matrix or of include; "
                    "a point runs once: for more runs of every point set repeats: N"
                )
            seen.add(frozenset(key_parts(point)))
        return self

    def combinations(self) -> list[dict[str, Any]]:
        """The matrix's points: one value of each axis, in the cartesian product's order."""
        return [dict(zip(self.matrix, values, strict=True)) for values in itertools.product(*self.matrix.values())]


def check_distinct(axis: str, values: list[Any]) -> None:
    """Refuse an axis value given twice, or two values that name one point: a point's key names its
    log file and is what --resume matches by, so the second run would take the first one's place."""
    named: dict[str, Any] = {}
    for value in values:
        part = key_parts({axis: value})[0]
        if part in named and named[part] == value:
            raise ValueError(
                f"axis {axis} gives {shown(value)} twice; a point runs once per value: for more runs of "
                "every point set repeats: N"
            )
        if part in named:
            raise ValueError(
                f"axis {axis} gives {shown(named[part])} and {shown(value)}, which both name the point "
                f"{part}; give them distinct values or labels"
            )
        named[part] = value


def check_axis_values(axes: dict[str, list[Any]]) -> None:
    for value in axes.get("topology", []):
        if not TOPOLOGY.match(str(value)):
            raise ValueError(f"topology {value!r} is not NODESxRANKS, e.g. 1x2")
    for preset in axes.get("strategy", []):
        strategy_config(str(preset))  # a ConfigError (a ValueError) naming the presets or the bad option


def strategy_config(preset: str) -> StrategyConfig:
    """A strategy preset (a shipped name or a YAML file) validated into its config class: what
    the sweep needs to know of a point's strategy (its launcher, whether it runs one process)."""
    section = read_sections(find_preset(preset, "strategies", "strategy"))
    try:
        return STRATEGY.validate_python(section)
    except ValidationError as err:
        data = {"strategy": section}
        lines = [describe_error({**e, "loc": ("strategy", *e["loc"])}, data) for e in err.errors()]
        raise ConfigError(f"strategy {preset} is invalid: " + "; ".join(lines)) from None


@dataclass(frozen=True)
class Point:
    """One run of a sweep."""

    axes: dict[str, Any]
    strategy: str | None
    nodes: int
    procs_per_node: int
    overrides: list[str]
    repeat: int = 0  # which run of a repeated point
    repeats: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def key(self) -> str:
        """A readable, file-name-safe identifier of the point."""
        return point_key(self.axes, [f"run={self.repeat + 1}of{self.repeats}"] if self.repeats > 1 else [])


def key_parts(axes: dict[str, Any]) -> list[str]:
    """``axis=label`` for each axis of a point, as its key spells them (file-name-safe)."""
    return [re.sub(r"[^A-Za-z0-9_.=,+-]", "", f"{k.split('.')[-1]}={axis_label(v)}") for k, v in axes.items()]


def point_key(axes: dict[str, Any], extra: Sequence[str] = ()) -> str:
    return "_".join([*key_parts(axes), *extra])


def shown(value: Any) -> str:
    """An axis value as a message quotes it (a string quoted, so 1 and '1' read apart)."""
    return repr(value) if isinstance(value, str) else json.dumps(value)


def axis_label(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("label") or json.dumps({k: v for k, v in value.items() if k != "label"}))
    return value if isinstance(value, str) else json.dumps(value)


def axis_overrides(axis: str, value: Any) -> list[str]:
    """``--set`` overrides for one axis value; a mapping value is a bundle of them."""
    if axis in ("strategy", "topology"):
        return []
    if isinstance(value, dict):
        return [f"{k}={json.dumps(v)}" for k, v in value.items() if k != "label"]
    return [f"{axis}={json.dumps(value)}"]


def load_study(path: str | Path) -> StudyConfig:
    data = read_sections(path if Path(path).exists() else find_file(str(path), "study", "study file"))
    try:
        return StudyConfig.model_validate(data)
    except ValidationError as err:
        lines = [describe_error(e, data, StudyConfig) for e in err.errors()]
        raise ConfigError(f"{path} is not a valid study:\n" + "\n".join(f"  - {line}" for line in lines)) from None


def expand(study: StudyConfig, extra: Sequence[str] = ()) -> tuple[list[Point], list[str]]:
    """The study's points, and a note for each combination that cannot run. ``extra``: ``--set``
    overrides given to the sweep, applied to every point after the study's own."""
    combinations = study.combinations()
    points, skipped = [], []
    # Repeats are the outer loop: each round runs every point once, so a machine whose speed
    # drifts during the sweep affects every point alike rather than one point's repeats.
    for repeat in range(study.repeats):
        for chosen in combinations + list(study.include):
            shape = TOPOLOGY.match(str(chosen.get("topology", "1x1")))
            assert shape is not None  # StudyConfig's validators have checked every topology
            nodes, procs = (int(n) for n in shape.groups())
            strategy = chosen.get("strategy")
            # A strategy without a process group cannot share work between ranks: it runs one process.
            if strategy is not None and nodes * procs > 1 and not strategy_config(str(strategy)).needs_process_group:
                if repeat == 0:
                    skipped.append(
                        f"strategy={strategy} with topology {chosen['topology']}: {strategy} runs one process"
                    )
                continue
            overrides = [f"study={study.study}"]
            overrides += [f"{k}={json.dumps(v)}" for k, v in study.set.items()]
            overrides += [o for k, v in chosen.items() for o in axis_overrides(k, v)]
            overrides += [f"{k}={v * nodes * procs}" for k, v in study.per_rank.items()]
            overrides += list(extra)
            points.append(
                Point(
                    axes=chosen,
                    strategy=strategy,
                    nodes=nodes,
                    procs_per_node=procs,
                    overrides=overrides,
                    repeat=repeat,
                    repeats=study.repeats,
                )
            )
    return points, skipped
