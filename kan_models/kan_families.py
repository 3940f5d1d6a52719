"""The KAN families by name, and the parser of one KAN config: what an MLP baseline is matched
against (``mlp.py``'s ``match``). It sits below the MLP and the registry, which adds the MLP and
users' own models to these; a new KAN family is one module plus one line here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from kan_models.base import ModelConfig, one_of
from kan_models.bspline import BSplineConfig
from kan_models.chebyshev import ChebyshevConfig
from kan_models.pykan_adapter import PyKANConfig
from kan_models.rbf import RBFConfig

KAN_FAMILIES: dict[str, type[ModelConfig]] = {
    "bspline": BSplineConfig,
    "rbf": RBFConfig,
    "chebyshev": ChebyshevConfig,
    "pykan": PyKANConfig,
}

if TYPE_CHECKING:
    AnyKANConfig = ModelConfig
else:
    AnyKANConfig = one_of(KAN_FAMILIES.values(), "family")
_adapter: TypeAdapter[ModelConfig] = TypeAdapter(AnyKANConfig)


def parse_kan_config(data: dict[str, Any]) -> ModelConfig:
    """Validate a KAN model config dict into its family's config object."""
    return _adapter.validate_python(data)
