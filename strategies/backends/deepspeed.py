"""``deepspeed``: DeepSpeed ZeRO stages 0-3, with optimizer and parameter offload to the CPU.

The DeepSpeed config is assembled from three sources, in this order: a native DeepSpeed JSON
file (``strategy.config``, optional), the strategy's own options (ZeRO stage, offload, buckets),
and the experiment's training section (batch sizes, gradient clipping, precision). The suite's
optimizer is passed in as an object and the loop sets each step's learning rate, so the file's
optimizer and scheduler blocks are read into the experiment's training section instead
(:mod:`strategies.backends.deepspeed_training`). Checking the merged file against the experiment
and filling its ``"auto"`` values is :mod:`strategies.backends.deepspeed_config`'s job, shared with
Accelerate's DeepSpeed plugin; the engine is :mod:`strategies.backends.deepspeed_engine`.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator
from torch import nn

from analysis.projection.strategy_model import StrategyModel
from kan_models.base import ModelConfig
from kanscale.errors import ConfigError
from kanscale.files import find_file, read_mapping
from strategies.backends.deepspeed_blocks import as_blocks
from strategies.backends.deepspeed_config import (
    AUTO,
    EQUIVALENT_VALUES,
    OPTION_KEYS,
    Resolution,
    check_async_io,
    get_path,
    hidden_size,
    hidden_size_values,
    resolve_native,
    set_path,
    warn_unchecked,
)
from strategies.backends.deepspeed_engine import DeepSpeedEngine, initial_weights, zero_label
from strategies.backends.deepspeed_training import adopted_training, decided, with_decides_advice
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import MeshShape
from strategies.sections import TrainingConfig
from strategies.step.engine import Engine
from strategies.step.optim import build_optimizer
from strategies.step.precision_support import deepspeed_lacks
from strategies.strategy import StrategyConfig


def accelerator_env(device_type: str) -> dict[str, str]:
    """The environment DeepSpeed needs in a process on ``device_type``: it picks its accelerator
    when it is first imported, and without GPUs it must be told to use the CPU. Every place that
    starts or becomes a DeepSpeed process (the deepspeed launcher, this backend, Accelerate's
    DeepSpeed plugin) takes it from here."""
    return {"DS_ACCELERATOR": "cpu"} if device_type == "cpu" else {}


def prepare_import(device_type: str) -> None:
    """Set :func:`accelerator_env` in this process (where not already set), before deepspeed is
    imported. On CPUs, DeepSpeed's communication backend would compile its shared-memory op
    (``deepspeed_shm_comm``, a long build, and a failed start without a C++ compiler) when
    it starts; the op serves only ``inference_all_reduce``, which training never calls (ZeRO's
    collectives are torch.distributed's), so it is marked unavailable and nothing is built."""
    for key, value in accelerator_env(device_type).items():
        os.environ.setdefault(key, value)
    if device_type == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps this one dict


def native_file_section(path: str) -> dict[str, str]:
    """The strategy section that trains with DeepSpeed from the native JSON at ``path``
    (``--deepspeed-config``)."""
    return {"name": "deepspeed", "config": path}


class DeepSpeedConfig(StrategyConfig):
    """DeepSpeed ZeRO stage 0-3 with optional CPU offload."""

    name: Literal["deepspeed"]
    config: str | None = Field(
        None, description="native DeepSpeed JSON to start from, e.g. configs/deepspeed/zero2.json"
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="0 = data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters"
    )
    decides: Literal["check", "file", "experiment"] = Field(
        "check",
        description="where the config file and the experiment state different training values (batch "
        "sizes, accumulation, clipping, optimizer, schedule, precision): check refuses with the --set "
        "lines of both sides, file takes the file's, experiment keeps the experiment's",
    )
    offload_optimizer: bool = Field(False, description="ZeRO-Offload: optimizer state and step on the CPU (stage 1-3)")
    offload_param: bool = Field(False, description="ZeRO-Infinity: parameters on the CPU between uses (stage 3)")
    overlap_comm: bool = Field(False, description="overlap gradient reduction with the backward pass")
    contiguous_gradients: bool = Field(True, description="copy gradients into one buffer as they are produced")
    reduce_bucket_size: int = Field(
        500_000_000,
        ge=0,
        description="elements reduced at a time (0: each gradient "
        "on its own, as Transformers' ZeRO-3 test config has "
        "it; run and recorded as 1, which DeepSpeed takes)",
    )
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="elements gathered at a time (stage 1-2)")
    param_persistence_threshold: int = Field(
        0,
        ge=0,
        description="stage 3: parameters smaller than this stay whole on every rank; DeepSpeed's default, "
        "100000, would keep every parameter of the study's models unsharded",
    )
    hpz_partition_size: int = Field(
        1,
        ge=1,
        description="stage 3, ZeRO++ hierarchical partitioning: each group of this many consecutive ranks (the "
        "GPUs of one node) keeps a second copy of the parameters sharded among itself, so "
        "backward's all-gather stays inside the node; 1: off",
    )
    quantized_weights: bool = Field(False, description="stage 3, ZeRO++ qwZ: all-gather parameters in int8 (CUDA only)")
    quantized_gradients: bool = Field(
        False, description="stage 3, ZeRO++ qgZ: reduce-scatter gradients in int4/int8 (CUDA only)"
    )

    @field_validator("reduce_bucket_size")
    @classmethod
    def _as_deepspeed_runs_it(cls, value: int) -> int:
        return cls._from_native("reduce_bucket_size", value)

    # The native file as read, and each resolution by (training, world size): a process reads the
    # file once and resolves it once, however often the record, the checks and the backend ask.
    _native: dict[str, Any] | None = PrivateAttr(None)
    _resolutions: dict[tuple[str, int], Resolution] = PrivateAttr(default_factory=dict)

    def native(self) -> dict[str, Any]:
        """The native file's contents (a copy to change freely), every block a mapping (a whole
        block written as "auto" read as one: strategies/backends/deepspeed_blocks.py); {} without one."""
        if self._native is None and self.config is not None:
            path = find_file(self.config, "strategy.config", "DeepSpeed config")
            self._native, malformed = as_blocks(read_mapping(path, "strategy.config", what="a JSON object"), str(path))
            if malformed:  # every later check reads these blocks as mappings
                raise ConfigError(f"strategy.config: {path}: " + "; ".join(malformed))
        return copy.deepcopy(self._native or {})

    def resolved(self, model: ModelConfig) -> DeepSpeedConfig:
        """These options with what the native file sets filled in, so that what the run records
        is what DeepSpeed runs (a ``zero3`` preset records ``zero_stage: 3``; an ``"auto"``
        bucket size records the number it becomes for ``model``). Where the file and an option
        given in the strategy section disagree, :meth:`resolution` refuses the run."""
        native = self.native()
        sized = hidden_size_values(hidden_size(model))
        from_file = {}
        for option, path in OPTION_KEYS.items():
            value = get_path(native, path)
            value = sized.get(path) if value == AUTO else value  # Accelerate's value for this model, where it has one
            if option not in self.model_fields_set and value is not None:
                from_file[option] = self._from_native(option, value)
        try:
            merged = type(self).model_validate({**self.model_dump(exclude_unset=True), "name": self.name, **from_file})
        except ValidationError as err:
            raise ConfigError(self._file_values_refused(err, from_file)) from None
        merged._native = self._native
        return StrategyConfig.resolved(merged, model)

    def _file_values_refused(self, err: ValidationError, from_file: dict[str, Any]) -> str:
        """A native file's values that the strategy's options refuse, each named by the file and
        its full key, with the ``--set`` line that decides the option instead."""
        lines = []
        for error in err.errors():
            option = str(error["loc"][0]) if error["loc"] else ""
            if option not in from_file:
                lines.append(f"strategy.{option}: {error['msg']}")
                continue
            lines.append(
                f"{'.'.join(OPTION_KEYS[option])} is {error.get('input')!r} in {self.config}: "
                f"{error['msg'].removeprefix('Value error, ')}; change it in {self.config}, or decide it with "
                f"--set strategy.{option}=VALUE"
            )
        return f"strategy.config: {self.config}: " + "; ".join(lines)

    def native_training(self, training: TrainingConfig) -> TrainingConfig:
        if self.config is None:
            return super().native_training(training)
        native, open_training = decided(self.native(), training, self.decides)
        return adopted_training(native, self.config, open_training, offer_decides=True)

    @staticmethod
    def _from_native(option: str, value: Any) -> Any:
        """A native file's value in the option's terms (offload devices are on/off here; a value
        DeepSpeed refuses but runs by another, as it runs)."""
        if option.startswith("offload_"):
            return value not in ("none", None)
        refused, same = EQUIVALENT_VALUES.get(OPTION_KEYS[option], (None, None))
        return same if refused is not None and value == refused else value

    def label(self) -> str:
        label = zero_label(self.zero_stage, self.offload_optimizer or self.offload_param)
        return label + ("_hpz" if self.hpz_partition_size > 1 else "") + ("_quantized" if self.quantized else "")

    @property
    def quantized(self) -> bool:
        return self.quantized_weights or self.quantized_gradients

    def option_values(self) -> dict[str, Any]:
        """The strategy options in DeepSpeed's terms."""
        values = self.model_dump(exclude={"name", "config", "decides"})
        for option in ("offload_optimizer", "offload_param"):
            values[option] = "cpu" if values[option] else "none"
        return values

    def resolution(self, training: TrainingConfig, world_size: int) -> Resolution:
        """The native file with the strategy options merged in, checked and resolved for this
        experiment (once per process: the answer is kept); a ConfigError names every problem."""
        key = (training.model_dump_json(), world_size)
        if key not in self._resolutions:
            self._resolutions[key] = self._resolve(training, world_size)
        return self._resolutions[key]

    def _resolve(self, training: TrainingConfig, world_size: int) -> Resolution:
        merged, training = decided(self.native(), training, self.decides)
        source = self.config or "the DeepSpeed config"
        conflicts = []
        for option, value in self.option_values().items():
            path = OPTION_KEYS[option]
            native = get_path(merged, path)
            if native in (None, AUTO):
                set_path(merged, path, value)  # the file leaves it open: the strategy option (or its default) decides
            elif option in self.model_fields_set and self._from_native(option, native) != getattr(self, option):
                conflicts.append(f"{'.'.join(path)}={native!r} but strategy.{option}={value!r}")
            # otherwise the file decides what the strategy section left at its default
        resolution = resolve_native(merged, training, world_size, hidden_size(self.resolved_model()), source)
        problems = conflicts + resolution.problems
        if problems:
            problems = with_decides_advice(problems)
            raise ConfigError(f"strategy.config: {source} cannot run as given: " + "; ".join(problems))
        self._check_stage(resolution.config)
        return resolution

    def resolve(self, training: TrainingConfig, world_size: int) -> dict[str, Any]:
        """The DeepSpeed config this run uses (a copy), or a ConfigError naming every problem."""
        return copy.deepcopy(self.resolution(training, world_size).config)

    @staticmethod
    def _check_stage(resolved: dict[str, Any]) -> None:
        stage = get_path(resolved, ("zero_optimization", "stage")) or 0
        if get_path(resolved, OPTION_KEYS["offload_optimizer"]) not in (None, "none") and stage < 1:
            raise ConfigError(
                "strategy.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3; "
                "set strategy.zero_stage to 1-3 or offload_optimizer=false"
            )
        if get_path(resolved, OPTION_KEYS["offload_param"]) not in (None, "none") and stage != 3:
            raise ConfigError(
                "strategy.offload_param: parameter offload needs ZeRO stage 3; set strategy.zero_stage=3 "
                "or offload_param=false"
            )

    def missing_precision_support(self, precision: str, device_type: str) -> str | None:
        return deepspeed_lacks(precision, device_type)

    def mesh_shape(self, world_size: int, ranks_per_node: int | None = None) -> MeshShape:
        # DeepSpeed partitions over its own data-parallel group, the world: stage 0 keeps whole
        # replicas. ZeRO++'s secondary partition (hpz) is a copy beside the primary one, groups of
        # consecutive ranks that must lie inside a node.
        if self.hpz_partition_size > 1:
            per_node = ranks_per_node or world_size
            if per_node % self.hpz_partition_size or world_size % self.hpz_partition_size:
                raise ConfigError(
                    f"strategy.hpz_partition_size: {self.hpz_partition_size} ranks per secondary partition "
                    f"must divide the ranks of one node ({per_node}) and the world size ({world_size}), or "
                    "a partition would span nodes; set it to the ranks per node, or a divisor of it"
                )
        return MeshShape(dp_replicate=world_size) if self.zero_stage == 0 else MeshShape(dp_shard=world_size)

    def cost_model(self) -> StrategyModel | None:
        """As counted on the presets' runs (DeepSpeed 0.19, overlap_comm off, buckets of 500M
        elements: one collective per kind for every zoo model): stage 0 all-reduces the gradients
        (its data-parallel fallback; the norm only when it clips); stages 1 and 2 also all-reduce
        the gradient norm and all-gather the updated partitions; stage 3 gathers every parameter
        once before forward (one prefetch bucket, kept through backward) and reduce-scatters the
        gradients. Overlapped communication, parameter offload and ZeRO++ are not modelled yet."""
        if self.overlap_comm or self.offload_param or self.hpz_partition_size > 1 or self.quantized:
            return None
        label, offload = self.label(), self.offload_optimizer
        if self.zero_stage == 0:
            return StrategyModel(label, grads="all_reduce", casts_module=True)
        if self.zero_stage < 3:
            return StrategyModel(
                label,
                grads="all_reduce",
                gather="after_step",
                sharded_state=True,
                master=True,
                norm=True,
                offload=offload,
                casts_module=True,
            )
        return StrategyModel(
            label,
            grads="reduce_scatter",
            gather="before_forward",
            sharded_state=True,
            sharded_params="all",
            master=True,
            norm=True,
            offload=offload,
            casts_module=True,
        )

    def backend_config_preview(self, training: TrainingConfig, world_size: int) -> tuple[str, dict[str, Any]]:
        return "the DeepSpeed config every rank passes to deepspeed.initialize", self.resolve(training, world_size)

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "strategy.name: deepspeed is not installed; pip install deepspeed (or pick another strategy)"
            )
        if (self.hpz_partition_size > 1 or self.quantized) and self.zero_stage != 3:
            raise ConfigError(
                f"strategy.zero_stage: ZeRO++ (hpz_partition_size, quantized_weights, quantized_gradients) "
                f"is part of stage 3, and zero_stage is {self.zero_stage}; set strategy.zero_stage=3 or "
                "drop the ZeRO++ options"
            )
        if self.quantized and device_type != "cuda":
            # qwZ and qgZ quantize in DeepSpeed's CUDA quantizer kernels; its CPU accelerator has none
            asked = [o for o in ("quantized_weights", "quantized_gradients") if getattr(self, o)]
            raise ConfigError(
                f"strategy.{asked[0]}: ZeRO++'s quantized collectives run DeepSpeed's CUDA quantizer "
                "kernels, which its CPU accelerator does not have; set "
                + " and ".join(f"strategy.{o}=false" for o in asked)
                + " on a CPU-only machine (hpz runs "
                "on CPUs)"
            )
        warn_unchecked(resolution := self.resolution(training, world_size), f"strategy.config: {self.config}")
        check_async_io(resolution.config, accelerator_env(device_type))

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        resolution = self.resolution(training, env.world_size)
        ds_config, training = copy.deepcopy(resolution.config), resolution.training
        prepare_import(env.device.type)
        # DeepSpeed reads the rank from the environment every launcher exports; a process started
        # by hand (a one-rank group, the baseline of a scaling curve) exports none.
        for key, value in {"LOCAL_RANK": env.local_rank, "RANK": env.rank, "WORLD_SIZE": env.world_size}.items():
            os.environ.setdefault(key, str(value))
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        optimizer = build_optimizer(model.parameters(), training)
        initial = initial_weights(model, training)
        ds_engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        return DeepSpeedEngine(ds_engine, training, env.world_size, ds_config, initial)
