"""``single``: one process, no wrapper. The reference every other strategy is compared to."""

from __future__ import annotations

from typing import ClassVar, Literal

from torch import nn

from analysis.projection.strategy_model import StrategyModel
from kanscale.errors import ConfigError
from strategies.runtime.distributed import DistEnv
from strategies.sections import TrainingConfig
from strategies.step.engine import Engine
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp
from strategies.strategy import StrategyConfig


class SingleConfig(StrategyConfig):
    """One process, plain PyTorch."""

    name: Literal["single"]
    needs_process_group: ClassVar[bool] = False
    reference: ClassVar[bool] = True
    preferred_launcher: ClassVar[str | None] = "none"
    compiles_step: ClassVar[bool] = True

    def cost_model(self) -> StrategyModel:
        return StrategyModel(self.label(), grads="none")

    def preflight(self, training: TrainingConfig, device_type: str, world_size: int) -> None:
        if world_size > 1:
            raise ConfigError(
                f"strategy.name: single trains in one process but {world_size} ranks were launched; "
                "launch one process or choose a distributed strategy (kanscale train --help lists the presets)"
            )

    def apply(self, model: nn.Module, training: TrainingConfig, env: DistEnv) -> Engine:
        return Engine(
            model, build_optimizer(model.parameters(), training), training, Amp.autocast(training, env.device.type)
        )
