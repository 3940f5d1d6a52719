"""``single``: one process, no wrapper. The reference every other strategy is compared to."""

from __future__ import annotations

from typing import Literal

from torch import nn

from strategies.config import ConfigError, TrainingConfig
from strategies.distributed import DistEnv
from strategies.engine import Engine, StrategyConfig
from strategies.optim import build_optimizer


class SingleConfig(StrategyConfig):
    """One process, plain PyTorch."""

    name: Literal["single"]

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        if env.world_size > 1:
            raise ConfigError(
                f"strategy.name: single trains in one process but {env.world_size} ranks were launched; "
                "launch one process or choose a distributed strategy")
        return Engine(model, build_optimizer(model.parameters(), training), training)
