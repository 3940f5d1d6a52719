"""Gaussian radial-basis KAN (FastKAN, Li 2024): the B-spline bases are replaced by G Gaussian
bumps exp(-((x - c_j) / h)^2) at uniformly spaced centres c_j, h the centre spacing, after an
optional LayerNorm that keeps inputs inside the centres' range; a SiLU base path is added."""

from __future__ import annotations

import itertools
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kan_models.base import Interval, LayerSplit, LayerStack, ModelConfig


class RBFKANLayer(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        grid: int = 8,
        grid_range: tuple[float, float] = (-2.0, 2.0),
        layernorm: bool = True,
        base: bool = True,
        init_scale: float = 0.1,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.grid = in_features, out_features, grid
        low, high = grid_range
        self.register_buffer("centers", torch.linspace(low, high, grid))
        self.inv_width = (grid - 1) / (high - low)
        self.norm = nn.LayerNorm(in_features) if layernorm else nn.Identity()
        self.spline = nn.Linear(in_features * grid, out_features, bias=False)
        nn.init.trunc_normal_(self.spline.weight, std=init_scale)
        self.base = nn.Linear(in_features, out_features) if base else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x).unsqueeze(-1)
        basis = torch.exp(-(((z - self.centers) * self.inv_width) ** 2))
        out = self.spline(basis.flatten(1))
        if self.base is not None:
            out = out + self.base(F.silu(x))
        return out

    def layer_split(self) -> LayerSplit:
        outputs = {"spline.weight": 0, **({"base.weight": 0, "base.bias": 0} if self.base is not None else {})}
        if isinstance(self.norm, nn.LayerNorm):
            # The LayerNorm's statistics run over the whole input row: the inputs do not split.
            return LayerSplit(outputs=outputs, inputs=None)
        # spline.weight is (out, in * G), in-major like the flattened bases: a chunk of whole inputs.
        inputs = {"spline.weight": 1, **({"base.weight": 1} if self.base is not None else {})}
        return LayerSplit(outputs=outputs, inputs=inputs, once=("base.bias",) if self.base is not None else ())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, grid={self.grid}"


class RBFConfig(ModelConfig):
    """Gaussian RBF KAN (FastKAN-style): G Gaussian bumps per edge, LayerNorm, SiLU base."""

    family: Literal["rbf"]
    identity: ClassVar[tuple[str, ...]] = ("grid",)
    resolution: ClassVar[dict[str, str]] = {"grid": "grid"}
    grid: int = Field(8, ge=2, le=1000, description="number of Gaussian centres")
    grid_range: Interval = Field((-2.0, 2.0), description="centres span [low, high]")
    layernorm: bool = True
    base: bool = Field(True, description="add the SiLU base path")
    init_scale: float = Field(0.1, ge=0.0, description="std of the initial RBF weights")

    def build(self) -> LayerStack:
        return LayerStack(
            [
                RBFKANLayer(i, o, self.grid, self.grid_range, self.layernorm, self.base, self.init_scale)
                for i, o in itertools.pairwise(self.widths)
            ]
        )
