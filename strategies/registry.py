"""The strategies' one registry: name -> config class. A new strategy is one module plus one
line here plus one preset file in configs/strategies/ (named by the strategy's label)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Union

import torch
from pydantic import Field

from strategies.backends.accelerate import AccelerateConfig
from strategies.backends.dcp import ShardedCheckpoints
from strategies.backends.ddp import DDPConfig
from strategies.backends.deepspeed import DeepSpeedConfig
from strategies.backends.deepspeed_engine import DeepSpeedEngine
from strategies.backends.fsdp1 import FSDP1Config
from strategies.backends.fsdp2 import FSDP2Config
from strategies.backends.single import SingleConfig
from strategies.backends.tp import FSDP2TPConfig, TPConfig
from strategies.step.engine import Engine
from strategies.strategy import StrategyConfig

# checkpoint format -> how to merge a checkpoint of it into one state dict, from the engine
# classes that write each format
CHECKPOINT_FORMATS: dict[str, Callable[[Path], dict[str, torch.Tensor]]] = {
    engine.checkpoint_format: engine.consolidate for engine in (Engine, ShardedCheckpoints, DeepSpeedEngine)
}

STRATEGIES: dict[str, type[StrategyConfig]] = {
    "single": SingleConfig,
    "ddp": DDPConfig,
    "fsdp1": FSDP1Config,
    "fsdp2": FSDP2Config,
    "deepspeed": DeepSpeedConfig,
    "accelerate": AccelerateConfig,
    "tp": TPConfig,
    "fsdp2_tp": FSDP2TPConfig,
}

if TYPE_CHECKING:
    # A type checker cannot read a union built at run time; every member is a StrategyConfig.
    AnyStrategyConfig = StrategyConfig
else:
    # A union built from the registry: the X | Y syntax cannot spread a tuple
    AnyStrategyConfig = Annotated[Union[tuple(STRATEGIES.values())], Field(discriminator="name")]  # noqa: UP007
