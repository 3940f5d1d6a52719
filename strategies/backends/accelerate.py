"""``accelerate``: the training step driven through Hugging Face Accelerate.

Which distributed type runs (multi-CPU/GPU DDP, the FSDP plugin, the DeepSpeed plugin) is not
chosen here but by the accelerate launch config the run was started with
(``accelerate launch --config_file configs/accelerate/<x>.yaml``); the engine records what
Accelerate reports. Two silent failure modes of Accelerate are refused instead of recorded:
several ranks that each train alone (distributed type NO: Accelerate's FSDP plugin does this on
machines without GPUs), and a requested plugin that Accelerate quietly replaced. A DeepSpeed
JSON the launch config names (``deepspeed_config_file``) gets the direct route's checks, before
launch, and its ``"auto"`` values are filled by the same function inside the rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from analysis.records.schema import ModelStateBytes
from kanscale.errors import ConfigError
from kanscale.extras import require
from kanscale.files import find_file, read_mapping
from strategies.backends.accelerate_launch import (
    DEEPSPEED_PLUGIN,
    FP16_CPU_MESSAGE,
    GPU_ONLY_MESSAGE,
    MIXED_PRECISION,
    launch_config_conflicts,
)
from strategies.backends.ddp import DDPEngine
from strategies.backends.deepspeed import prepare_import
from strategies.backends.deepspeed_config import hidden_size, resolve_native, warn_unchecked
from strategies.backends.deepspeed_engine import DeepSpeedEngine, initial_weights
from strategies.backends.deepspeed_training import adopted_training
from strategies.backends.fsdp1 import FSDP1Engine
from strategies.backends.fsdp2 import FSDP2Engine
from strategies.runtime.distributed import DistEnv
from strategies.sections import TrainingConfig
from strategies.step.engine import Batch, Engine, LossFn
from strategies.step.optim import build_optimizer
from strategies.step.precision_support import autocast_lacks, deepspeed_lacks
from strategies.strategy import StrategyConfig


def requested_plugin() -> str | None:
    """The plugin ``accelerate launch`` was asked for, from the environment it exports."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "DEEPSPEED"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "FSDP"
    return None


class AccelerateConfig(StrategyConfig):
    """Hugging Face Accelerate; the distributed type comes from the accelerate launch config."""

    name: Literal["accelerate"]
    preferred_launcher: ClassVar[str | None] = "accelerate"
    config_file: str | None = Field(
        None,
        description="the accelerate launch config this experiment is meant to run under (configs/accelerate/*.yaml); "
        "checked against the experiment before launch",
    )

    def launch_config(self) -> str | None:
        return self.config_file

    def native_training(self, training: TrainingConfig) -> TrainingConfig:
        native = self._native_deepspeed()
        return super().native_training(training) if native is None else adopted_training(*native, training)

    def _native_deepspeed(self) -> tuple[dict[str, Any], str] | None:
        """The DeepSpeed JSON the launch config names (``deepspeed_config_file``) and its path: inside
        a rank, the one accelerate launch passed on; before launch, the one ``config_file`` names."""
        if requested_plugin() == "DEEPSPEED":
            path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        elif self.config_file is not None:
            launch = read_mapping(
                find_file(self.config_file, "strategy.config_file", "accelerate config"), "strategy.config_file"
            )
            ds = launch.get("deepspeed_config") if launch.get("distributed_type") == "DEEPSPEED" else None
            path = str((ds or {}).get("deepspeed_config_file") or "none")
        else:
            return None
        if path == "none" or not Path(path).is_file():
            return None  # no file, or one the launch check names as missing
        return read_mapping(path, "deepspeed_config.deepspeed_config_file", what="a JSON object"), path

    def missing_precision_support(self, precision: str, device_type: str) -> str | None:
        """DeepSpeed's answer inside a rank that accelerate launch started with the DeepSpeed plugin;
        before launch, :func:`launch_config_conflicts` asks the same of the launch config."""
        lacks = deepspeed_lacks if requested_plugin() == "DEEPSPEED" else autocast_lacks
        return lacks(precision, device_type)

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        if self.config_file is None:
            return
        path = find_file(self.config_file, "strategy.config_file", "accelerate config")
        problems = launch_config_conflicts(
            read_mapping(path, "strategy.config_file"), training, device_type, world_size, model=self.resolved_model()
        )
        if problems:
            raise ConfigError(f"strategy.config_file: {path}: " + "; ".join(problems))

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, InitProcessGroupKwargs

        plugin = requested_plugin()
        if plugin == "FSDP" and env.device.type != "cuda":
            raise ConfigError(GPU_ONLY_MESSAGE)
        if plugin == "DEEPSPEED":
            require("hf", DEEPSPEED_PLUGIN)
            prepare_import(env.device.type)
        accelerator = Accelerator(
            # On CPUs, cpu=True gives multi-CPU DDP, but it would also switch the DeepSpeed plugin off.
            cpu=env.device.type == "cpu" and plugin != "DEEPSPEED",
            gradient_accumulation_steps=training.grad_accum,
            mixed_precision=MIXED_PRECISION[training.precision],
            kwargs_handlers=[InitProcessGroupKwargs(backend="nccl" if env.device.type == "cuda" else "gloo")],
        )
        kind = accelerator.distributed_type
        if env.world_size > 1 and kind == DistributedType.NO:
            raise ConfigError(
                f"accelerate: {env.world_size} ranks were launched but Accelerate runs distributed type NO, "
                "so each rank would train alone; launch with a multi-process accelerate config"
            )
        if plugin is not None and kind.name != plugin:
            raise ConfigError(f"accelerate: the launch config asked for {plugin} but Accelerate runs {kind.name}")
        if training.precision == "fp16" and env.device.type == "cpu" and kind != DistributedType.DEEPSPEED:
            raise ConfigError(FP16_CPU_MESSAGE)
        # Accelerate's FSDP units; torch types a module's attributes as tensors and modules only
        model._no_split_modules = sorted({type(b).__name__ for b in self.wrap_units(model)})  # type: ignore[assignment]
        if kind == DistributedType.DEEPSPEED:
            inner, optimizer = self._prepare_deepspeed(accelerator, model, training, env)
        elif kind == DistributedType.FSDP:
            wrapped = accelerator.prepare(model)  # FSDP needs the optimizer built on the sharded parameters
            optimizer = accelerator.prepare(build_optimizer(wrapped.parameters(), training))
            fsdp_engine = FSDP2Engine if accelerator.state.fsdp_plugin.fsdp_version == 2 else FSDP1Engine
            inner = fsdp_engine(wrapped, optimizer, training, env.world_size)
        else:
            wrapped, optimizer = accelerator.prepare(model, build_optimizer(model.parameters(), training))
            inner = (
                DDPEngine(wrapped, optimizer, training, env.world_size)
                if isinstance(wrapped, DistributedDataParallel)
                else Engine(wrapped, optimizer, training)
            )
        return AccelerateEngine(accelerator, inner, optimizer, training, env.world_size)

    def _prepare_deepspeed(
        self, accelerator: Any, model: nn.Module, training: TrainingConfig, env: DistEnv
    ) -> tuple[Engine, Any]:
        # Resolved here, before prepare: Accelerate would fill the model-sized "auto"s only from a
        # model.config.hidden_size, which a KAN has not, and would leave the experiment's to defaults.
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        source = "the accelerate launch config's deepspeed_config" if source == "none" else source
        resolution = resolve_native(ds_config, training, env.world_size, hidden_size(self.resolved_model()), source)
        if resolution.problems:
            raise ConfigError(
                f"accelerate: the DeepSpeed plugin config ({source}) cannot run as given: "
                + "; ".join(resolution.problems)
            )
        warn_unchecked(resolution, source)
        ds_config.clear()
        ds_config.update(resolution.config)  # in place: the plugin's own dict is what Accelerate prepares with
        training = resolution.training  # the file's optimizer and precision taken in, as the experiment took them
        initial = initial_weights(model, training)
        _, optimizer = accelerator.prepare(model, build_optimizer(model.parameters(), training))
        engine = DeepSpeedEngine(
            accelerator.deepspeed_engine_wrapped.engine, training, env.world_size, ds_config, initial
        )
        return engine, optimizer


class AccelerateEngine(Engine):
    """Steps through Accelerate (``accumulate``, ``backward``, the prepared optimizer); asks the
    engine of the backend Accelerate chose for what that backend holds and how to gather it."""

    def __init__(
        self, accelerator: Any, inner: Engine, optimizer: Any, training: TrainingConfig, world_size: int
    ) -> None:
        super().__init__(inner.model, optimizer, training)
        self.accelerator, self.inner, self.world_size = accelerator, inner, world_size
        self.kind = f"accelerate_{inner.kind}"
        self.checkpoint_format = inner.checkpoint_format  # the backend Accelerate chose writes its own format
        self.label = self.kind
        mixed = accelerator.mixed_precision
        self.input_dtype = inner.input_dtype
        self.precision_mechanism = (
            inner.precision_mechanism
            if isinstance(inner, DeepSpeedEngine) and mixed != "no"
            else f"Accelerate mixed_precision={mixed}"
            if mixed != "no"
            else "none"
        )

    def forward_backward(
        self, batches: Sequence[Batch], loss_sum: LossFn, n_global: int, count_state: bool = False
    ) -> torch.Tensor:
        if count_state and isinstance(self.inner, DeepSpeedEngine):
            with self._counting_state_inside_deepspeed_step(self.inner.ds):
                return super().forward_backward(batches, loss_sum, n_global)
        return super().forward_backward(batches, loss_sum, n_global)

    @contextlib.contextmanager
    def _counting_state_inside_deepspeed_step(self, ds_engine: Any) -> Iterator[None]:
        """Under DeepSpeed, ``accelerator.backward`` itself steps at the accumulation boundary,
        so the state is counted inside DeepSpeed's step, while the gradients still exist."""
        deepspeed_step = ds_engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if ds_engine.is_gradient_accumulation_boundary() and self.counted_state is None:
                self.counted_state = self.model_state_bytes()
            return deepspeed_step(*args, **kwargs)

        ds_engine.step = step
        try:
            yield
        finally:
            ds_engine.step = deepspeed_step

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        # Accelerate counts micro-steps itself and syncs on every grad_accum-th; the loop runs
        # exactly grad_accum micro-steps per step, so the two agree.
        return self.accelerator.accumulate(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        # Accelerate (or DeepSpeed under it) divides by grad_accum, and the backend averages over
        # ranks; undo both so the gradient is that of the global-batch mean.
        self.accelerator.backward(loss * (self.world_size * self.training.grad_accum))

    def step(self, count_state: bool = False) -> None:
        if self.training.grad_clip > 0 and self.accelerator.distributed_type.name != "DEEPSPEED":
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.training.grad_clip)
        if count_state and self.counted_state is None:  # under DeepSpeed, the backward's step counted it
            self.counted_state = self.model_state_bytes()
        self.optimizer.step()  # under DeepSpeed, accelerator.backward already stepped at the boundary
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, directory: Path) -> None:
        self.inner.save(directory)

    def load(self, directory: Path) -> None:
        self.inner.load(directory)

    def model_state_bytes(self) -> ModelStateBytes:
        return self.inner.model_state_bytes()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_full_state_dict(state)

    def distributed_type(self) -> str:
        return self.accelerator.distributed_type.name

    def backend_config(self) -> dict | None:
        return self.inner.backend_config()
