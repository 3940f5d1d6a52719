"""The strategies' one registry: name -> config class. A new strategy is one module plus one
line here plus one config file."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from strategies.engine import StrategyConfig
from strategies.single import SingleConfig

STRATEGIES: dict[str, type[StrategyConfig]] = {
    "single": SingleConfig,
}

AnyStrategyConfig = Annotated[Union[tuple(STRATEGIES.values())], Field(discriminator="name")]
