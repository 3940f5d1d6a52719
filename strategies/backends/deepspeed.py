"""``deepspeed``: DeepSpeed ZeRO stages 0-3, with optimizer and parameter offload to the CPU.

The DeepSpeed config is assembled from three sources, in this order: a native DeepSpeed JSON
file (``strategy.config``, optional), the strategy's own options (ZeRO stage, offload, buckets),
and the experiment's training section (batch sizes, gradient clipping, precision). The suite's
optimizer is passed in as an object, so DeepSpeed's own optimizer and scheduler blocks are not
used. Checking the merged file against the experiment and filling its ``"auto"`` values is
:mod:`strategies.backends.deepspeed_config`'s job, shared with Accelerate's DeepSpeed plugin.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, PrivateAttr
from torch import nn

from analysis.projection.step_model import StrategyModel
from analysis.schema import ModelStateBytes
from kan_models.base import ModelConfig
from kanscale.errors import ConfigError
from kanscale.files import find_file, read_mapping
from strategies.backends.deepspeed_config import (
    AUTO,
    Resolution,
    check_async_io,
    get_path,
    hidden_size,
    hidden_size_values,
    resolve_native,
    set_path,
    warn_unchecked,
)
from strategies.distributed import DistEnv
from strategies.engine import Engine, detached_copy, optimizer_state_tensors, tensor_bytes
from strategies.mesh import MeshShape
from strategies.optim import build_optimizer
from strategies.precision import LOW_DTYPES
from strategies.precision_support import deepspeed_lacks
from strategies.sections import TrainingConfig
from strategies.strategy import StrategyConfig

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
}


def accelerator_env(device_type: str) -> dict[str, str]:
    """The environment DeepSpeed needs in a process on ``device_type``: it picks its accelerator
    when it is first imported, and without GPUs it must be told to use the CPU. Every place that
    starts or becomes a DeepSpeed process (the deepspeed launcher, this backend, Accelerate's
    DeepSpeed plugin) takes it from here."""
    return {"DS_ACCELERATOR": "cpu"} if device_type == "cpu" else {}


def prepare_import(device_type: str) -> None:
    """Set :func:`accelerator_env` in this process (where not already set), before deepspeed is imported."""
    for key, value in accelerator_env(device_type).items():
        os.environ.setdefault(key, value)


def native_file_section(path: str) -> dict[str, str]:
    """The strategy section that trains with DeepSpeed from the native JSON at ``path``
    (``--deepspeed-config``)."""
    return {"name": "deepspeed", "config": path}


def zero_label(stage: int, offloaded: bool) -> str:
    return f"zero{stage}" + ("_offload" if offloaded else "")


class DeepSpeedConfig(StrategyConfig):
    """DeepSpeed ZeRO stage 0-3 with optional CPU offload."""

    name: Literal["deepspeed"]
    config: str | None = Field(None, description="native DeepSpeed JSON to start from, e.g. configs/deepspeed/zero2.json")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="0 = data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload: optimizer state and step on the CPU (stage 1-3)")
    offload_param: bool = Field(False, description="ZeRO-Infinity: parameters on the CPU between uses (stage 3)")
    overlap_comm: bool = Field(False, description="overlap gradient reduction with the backward pass")
    contiguous_gradients: bool = Field(True, description="copy gradients into one buffer as they are produced")
    reduce_bucket_size: int = Field(500_000_000, ge=1, description="elements reduced at a time")
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="elements gathered at a time (stage 1-2)")
    param_persistence_threshold: int = Field(
        0, ge=0, description="stage 3: parameters smaller than this stay whole on every rank; DeepSpeed's default, "
                             "100000, would keep every parameter of the study's models unsharded")

    # The native file as read, and each resolution by (training, world size): a process reads the
    # file once and resolves it once, however often the record, the checks and the backend ask.
    _native: dict[str, Any] | None = PrivateAttr(None)
    _resolutions: dict[tuple[str, int], Resolution] = PrivateAttr(default_factory=dict)

    def native(self) -> dict[str, Any]:
        """The native file's contents (a copy to change freely); {} without one."""
        if self._native is None:
            self._native = {} if self.config is None else read_mapping(
                find_file(self.config, "strategy.config", "DeepSpeed config"), "strategy.config", what="a JSON object")
        return copy.deepcopy(self._native)

    def resolved(self, model: ModelConfig) -> "DeepSpeedConfig":
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
        merged = type(self).model_validate({**self.model_dump(exclude_unset=True), "name": self.name, **from_file})
        merged._native = self._native
        return StrategyConfig.resolved(merged, model)

    @staticmethod
    def _from_native(option: str, value: Any) -> Any:
        """A native file's value in the option's terms (offload devices are on/off here)."""
        return value not in ("none", None) if option.startswith("offload_") else value

    def label(self) -> str:
        return zero_label(self.zero_stage, self.offload_optimizer or self.offload_param)

    def option_values(self) -> dict[str, Any]:
        """The strategy options in DeepSpeed's terms."""
        values = self.model_dump(exclude={"name", "config"})
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
        merged = self.native()
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
            raise ConfigError(f"strategy.config: {source} cannot run as given: " + "; ".join(problems)
                              + ". The experiment config is the single source of the training values.")
        self._check_stage(resolution.config)
        return resolution

    def resolve(self, training: TrainingConfig, world_size: int) -> dict[str, Any]:
        """The DeepSpeed config this run uses (a copy), or a ConfigError naming every problem."""
        return copy.deepcopy(self.resolution(training, world_size).config)

    @staticmethod
    def _check_stage(resolved: dict[str, Any]) -> None:
        stage = get_path(resolved, ("zero_optimization", "stage")) or 0
        if get_path(resolved, OPTION_KEYS["offload_optimizer"]) not in (None, "none") and stage < 1:
            raise ConfigError("strategy.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3; "
                              "set strategy.zero_stage to 1-3 or offload_optimizer=false")
        if get_path(resolved, OPTION_KEYS["offload_param"]) not in (None, "none") and stage != 3:
            raise ConfigError("strategy.offload_param: parameter offload needs ZeRO stage 3; set strategy.zero_stage=3 "
                              "or offload_param=false")

    def missing_precision_support(self, precision: str, device_type: str) -> str | None:
        return deepspeed_lacks(precision, device_type)

    def mesh_shape(self, world_size: int) -> MeshShape:
        # DeepSpeed partitions over its own data-parallel group, the world: stage 0 keeps whole replicas
        return MeshShape(dp_replicate=world_size) if self.zero_stage == 0 else MeshShape(dp_shard=world_size)

    def cost_model(self) -> StrategyModel | None:
        """As counted on the presets' runs (DeepSpeed 0.19, overlap_comm off, buckets of 500M
        elements: one collective per kind for every zoo model): stage 0 all-reduces the gradients
        (its data-parallel fallback; the norm only when it clips); stages 1 and 2 also all-reduce
        the gradient norm and all-gather the updated partitions; stage 3 gathers every parameter
        once before forward (one prefetch bucket, kept through backward) and reduce-scatters the
        gradients. Overlapped communication and parameter offload are not modelled yet."""
        if self.overlap_comm or self.offload_param:
            return None
        label, offload = self.label(), self.offload_optimizer
        if self.zero_stage == 0:
            return StrategyModel(label, grads="all_reduce")
        if self.zero_stage < 3:
            return StrategyModel(label, grads="all_reduce", gather="after_step", sharded_state=True, master=True,
                                 norm=True, offload=offload)
        return StrategyModel(label, grads="reduce_scatter", gather="before_forward", sharded_state=True,
                             sharded_params="all", master=True, norm=True, offload=offload)

    def backend_config_preview(self, training: TrainingConfig, world_size: int) -> tuple[str, dict[str, Any]]:
        return "the DeepSpeed config every rank passes to deepspeed.initialize", self.resolve(training, world_size)

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("strategy.name: deepspeed is not installed; pip install deepspeed (or pick another strategy)")
        warn_unchecked(resolution := self.resolution(training, world_size), f"strategy.config: {self.config}")
        check_async_io(resolution.config, accelerator_env(device_type))

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        ds_config = self.resolve(training, env.world_size)
        prepare_import(env.device.type)
        # DeepSpeed reads the rank from the environment every launcher exports; a process started
        # by hand (a one-rank group, the baseline of a scaling curve) exports none.
        for key, value in {"LOCAL_RANK": env.local_rank, "RANK": env.rank, "WORLD_SIZE": env.world_size}.items():
            os.environ.setdefault(key, str(value))
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        optimizer = build_optimizer(model.parameters(), training)
        initial = initial_weights(model, training)
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
        return DeepSpeedEngine(ds_engine, training, env.world_size, ds_config, initial)


def initial_weights(model: nn.Module, training: TrainingConfig) -> dict[str, torch.Tensor] | None:
    """Under bf16/fp16, the model's full-precision weights before DeepSpeed casts it (see DeepSpeedEngine)."""
    return detached_copy(model.state_dict()) if training.precision != "fp32" else None


def master_tensors(zero: Any) -> list[torch.Tensor]:
    """The float32 master copies a DeepSpeed optimizer keeps: ZeRO 1-2's and 3's partitions, or
    under bf16/fp16 at stage 0 whole copies; none in full precision at stage 0."""
    return list(getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", None)
                or [m for group in getattr(zero, "fp32_groups", None) or [] for m in group])


def deepspeed_state_bytes(ds_engine: Any) -> ModelStateBytes:
    """What a DeepSpeed engine holds on this rank. ZeRO keeps the module's working parameters
    (stage 3: only this rank's partition, ``ds_tensor``, between uses), fp32 master partitions of
    them, reduced gradient partitions, and the wrapped optimizer's state on the master partitions.
    Under bf16/fp16 the working parameters are 16-bit and the masters float32, at stage 0 too."""
    zero = ds_engine.optimizer
    params = list(ds_engine.module.parameters())
    partitions = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    masters = master_tensors(zero)
    averaged = getattr(zero, "averaged_gradients", None) or {}
    averaged = [g for group in (averaged.values() if isinstance(averaged, dict) else averaged) for g in (group or []) if g is not None]
    inner = getattr(zero, "optimizer", zero)
    return ModelStateBytes(
        params=tensor_bytes(p.data for p in params) + tensor_bytes(partitions),
        grads=tensor_bytes(p.grad for p in params if p.grad is not None) + tensor_bytes(averaged)
        + tensor_bytes(m.grad for m in masters if m.grad is not None),
        optimizer=tensor_bytes(optimizer_state_tensors(inner)),
        master_params=tensor_bytes(masters),
    )


class DeepSpeedEngine(Engine):
    checkpoint_format = "deepspeed"
    TAG = "state"

    def __init__(self, ds_engine: Any, training: TrainingConfig, world_size: int, ds_config: dict[str, Any],
                 initial: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(ds_engine, ds_engine.optimizer, training)
        self.ds = ds_engine
        self.world_size = world_size
        self.ds_config = ds_config
        self.stage = ds_engine.zero_optimization_stage()
        self._boundary = True
        offloaded = any(get_path(ds_config, OPTION_KEYS[k]) not in (None, "none") for k in ("offload_optimizer", "offload_param"))
        self.kind = zero_label(self.stage, offloaded)
        low = next((LOW_DTYPES[key] for key in LOW_DTYPES if get_path(ds_config, (key, "enabled"))), None)
        if low is not None:
            # DeepSpeed casts the module, not its inputs; the optimizer steps float32 masters.
            self.input_dtype = low
            self.precision_mechanism = f"DeepSpeed {'bf16' if low == torch.bfloat16 else 'fp16 (dynamic loss scaling)'}"
            self._start_like_the_others(initial)

    def gradient_sync(self, enabled: bool):
        self._boundary = enabled
        return super().gradient_sync(enabled)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides the loss by gradient_accumulation_steps and averages gradients over
        # ranks; undo both so the gradient is that of the global-batch mean.
        self.ds.backward(loss * (self.world_size * self.training.grad_accum))
        if not self._boundary:
            self.ds.step()  # DeepSpeed counts micro-steps in step(); off the boundary it only counts

    def step(self) -> None:
        self._count_state_if_armed()
        self.ds.step()  # clipping comes from the config's gradient_clipping

    def model_state_bytes(self) -> ModelStateBytes:
        return deepspeed_state_bytes(self.ds)

    def updated_tensors(self) -> list[torch.Tensor]:
        # ZeRO-3 empties its optimizer's param groups between steps; its masters are what it updates.
        return master_tensors(self.ds.optimizer) or super().updated_tensors()

    def save(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=self.TAG, save_latest=False)

    @staticmethod
    def consolidate(directory: Path) -> dict[str, torch.Tensor]:
        """ZeRO 1-3 keep the authoritative fp32 weights in their optimizer partitions, which
        zero_to_fp32 merges; stage 0 saves the whole module. Buffers (spline knots) come from the
        saved module either way."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag_dir = directory / DeepSpeedEngine.TAG
        # mp_rank_00_model_states.pt, or under ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
        module = torch.load(sorted(tag_dir.glob("*model_states.pt"))[0], map_location="cpu", weights_only=False)["module"]
        if not any(tag_dir.glob("*optim_states.pt")) or not any(tag_dir.glob("zero_pp_rank_*")):
            return module
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DeepSpeedEngine.TAG)
        return {**{k: v for k, v in module.items() if k not in state}, **state}

    def load(self, directory: Path) -> None:
        self.ds.load_checkpoint(str(directory), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=False)

    @torch.no_grad()
    def _start_like_the_others(self, initial: dict[str, torch.Tensor] | None) -> None:
        """Under bf16/fp16 DeepSpeed starts from another point than every other strategy (0.19,
        found by the bf16 parity tests): it makes its float32 masters from the module after
        casting it to 16 bits, which rounds the initial weights, and at stage 0 it creates the
        optimizer's state with one step on zero gradients, which leaves Adam's moments at zero but
        its step count at 1, so every later bias correction is one step off (the first update is
        0.74 lr instead of lr). Start from the suite's weights and, at stage 0, a fresh step count."""
        if initial is not None:
            self.load_full_state_dict(initial)
        if self.stage > 0:
            return
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"]) if isinstance(state["step"], torch.Tensor) else 0

    def _stage0_masters(self) -> dict[int, torch.Tensor]:
        """Stage 0 under bf16/fp16: the float32 master of each module parameter (by id), which its
        optimizer keeps in lists beside the module's 16-bit ones; ZeRO 1-3 map theirs themselves."""
        opt = self.ds.optimizer
        return {id(low): high for lows, highs in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
                for low, high in zip(lows, highs)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.ds.module
        gather = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None, enabled=self.stage == 3)
        with gather:
            state = detached_copy(module.state_dict())
        if self.input_dtype is None:
            return state  # full precision: the module's parameters are the weights
        # Under bf16/fp16 the weights are the float32 masters (every rank takes part in gathering them).
        masters = self._stage0_masters()
        for name, param in module.named_parameters():
            master = safe_get_full_fp32_param(param) if self.stage > 0 else masters.get(id(param))
            if master is not None:
                state[name] = master.detach().clone()
        dtype = getattr(torch, self.training.dtype)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.ds.module
        names = dict(module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(names.values()), modifier_rank=0, enabled=self.stage == 3):
            module.load_state_dict(state)  # the working copy the forward pass uses
        masters = self._stage0_masters()
        for name, param in names.items():  # and the fp32 masters, which the next step copies back
            if self.stage > 0:
                safe_set_full_fp32_param(param, state[name].to(torch.float32))
            elif id(param) in masters:
                masters[id(param)].copy_(state[name])

    def distributed_type(self) -> str:
        return f"DEEPSPEED_ZERO{self.stage}"

    def backend_config(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.ds_config, default=str))  # plain JSON, for the record
