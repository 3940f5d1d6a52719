"""The zoo's one registry: family name -> config class, the KAN families (``kan_families.py``)
and the MLP baseline. The experiment config, ``kanscale models`` and the tests pick a family up
from this table. The registry imports the families; no family imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import TypeAdapter
from torch import nn

from kan_models.base import ModelConfig, one_of
from kan_models.custom import CustomConfig
from kan_models.kan_families import KAN_FAMILIES
from kan_models.mlp import MLPConfig

FAMILIES: dict[str, type[ModelConfig]] = {**KAN_FAMILIES, "mlp": MLPConfig}

# The experiment config's ``model`` field: one of the zoo's families, or a user's own model
# (``family: custom``), chosen by its ``family`` key.
if TYPE_CHECKING:
    AnyModelConfig = ModelConfig
else:
    AnyModelConfig = one_of([*FAMILIES.values(), CustomConfig], "family")
_adapter: TypeAdapter[ModelConfig] = TypeAdapter(AnyModelConfig)


def parse_model_config(data: dict[str, Any]) -> ModelConfig:
    """Validate a model config dict into its family's config object."""
    return _adapter.validate_python(data)


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Build the model with its initial weights drawn from ``seed``, leaving the global RNG
    state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return config.build()
