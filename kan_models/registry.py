"""The zoo's one registry: family name -> config class. A new family is one module plus one
line here; the experiment config, ``kanscale models`` and the tests pick it up from this table."""

from __future__ import annotations

from typing import Annotated, Any, Union

import torch
from pydantic import Field, TypeAdapter
from torch import nn

from kan_models.base import ModelConfig
from kan_models.bspline import BSplineConfig
from kan_models.chebyshev import ChebyshevConfig
from kan_models.custom import CustomConfig
from kan_models.mlp import MLPConfig
from kan_models.pykan_adapter import PyKANConfig
from kan_models.rbf import RBFConfig

FAMILIES: dict[str, type[ModelConfig]] = {
    "bspline": BSplineConfig,
    "rbf": RBFConfig,
    "chebyshev": ChebyshevConfig,
    "pykan": PyKANConfig,
    "mlp": MLPConfig,
}

# The experiment config's ``model`` field: one of the zoo's families, or a user's own model
# (``family: custom``), chosen by its ``family`` key.
AnyModelConfig = Annotated[Union[(*FAMILIES.values(), CustomConfig)], Field(discriminator="family")]
_adapter = TypeAdapter(AnyModelConfig)


def parse_model_config(data: dict[str, Any]) -> ModelConfig:
    """Validate a model config dict into its family's config object."""
    return _adapter.validate_python(data)


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Build the model with its initial weights drawn from ``seed``, leaving the global RNG
    state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return config.build()
