"""The strategies' one registry: name -> config class. A new strategy is one module plus one
line here plus one config file."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from strategies.ddp import DDPConfig
from strategies.engine import StrategyConfig
from strategies.fsdp1 import FSDP1Config
from strategies.fsdp2 import FSDP2Config
from strategies.hf_accelerate import AccelerateConfig
from strategies.single import SingleConfig
from strategies.zero import DeepSpeedConfig

STRATEGIES: dict[str, type[StrategyConfig]] = {
    "single": SingleConfig,
    "ddp": DDPConfig,
    "fsdp1": FSDP1Config,
    "fsdp2": FSDP2Config,
    "deepspeed": DeepSpeedConfig,
    "accelerate": AccelerateConfig,
}

AnyStrategyConfig = Annotated[Union[tuple(STRATEGIES.values())], Field(discriminator="name")]
