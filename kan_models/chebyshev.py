"""Chebyshev KAN (ChebyKAN): each edge's activation is a degree-D Chebyshev series of
tanh(x), phi_oi(x) = sum_n coef[i, o, n] T_n(tanh(x)). tanh squashes any input into [-1, 1],
where the polynomials are bounded; the recursion T_n = 2 z T_{n-1} - T_{n-2} keeps gradients
finite at the interval ends (unlike cos(n arccos z))."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from kan_models.base import LayerSplit, LayerStack, ModelConfig


def chebyshev_polynomials(z: torch.Tensor, degree: int) -> torch.Tensor:
    """T_0(z) .. T_degree(z) stacked on a new last axis."""
    polys = [torch.ones_like(z), z]
    for _ in range(2, degree + 1):
        polys.append(2 * z * polys[-1] - polys[-2])
    return torch.stack(polys[: degree + 1], dim=-1)


class ChebyshevKANLayer(nn.Module):
    def __init__(self, in_features: int, out_features: int, degree: int = 4) -> None:
        super().__init__()
        self.in_features, self.out_features, self.degree = in_features, out_features, degree
        std = 1.0 / math.sqrt(in_features * (degree + 1))
        self.coef = nn.Parameter(torch.randn(out_features, in_features, degree + 1) * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        polys = chebyshev_polynomials(torch.tanh(x), self.degree)  # (batch, in, D + 1)
        return polys.flatten(1) @ self.coef.flatten(1).T

    def layer_split(self) -> LayerSplit:
        return LayerSplit(outputs={"coef": 0}, inputs={"coef": 1})

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, degree={self.degree}"


class ChebyshevConfig(ModelConfig):
    """Chebyshev KAN: a degree-D Chebyshev series of tanh(x) per edge."""

    family: Literal["chebyshev"]
    identity: ClassVar[tuple[str, ...]] = ("degree",)
    resolution: ClassVar[dict[str, str]] = {"order": "degree"}
    degree: int = Field(4, ge=1, le=64, description="polynomial degree D")

    def build(self) -> LayerStack:
        return LayerStack([ChebyshevKANLayer(i, o, self.degree) for i, o in itertools.pairwise(self.widths)])
