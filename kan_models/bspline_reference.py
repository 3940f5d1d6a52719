"""B-spline KAN (Liu et al. 2024): every edge i -> o carries its own learnable activation

    phi_oi(x) = scale_base[o, i] * silu(x) + scale_spline[o, i] * sum_j coef[o, i, j] * B_j(x)

where B_j are the G + k B-spline bases of order k on a grid of G intervals over ``grid_range``,
extended by k knots on either side. This module is the straightforward Cox-de Boor
implementation most KAN libraries use, kept as the reference (``impl: reference``); the default
``impl: fast`` layer in ``bspline_fast.py`` computes the same function in closed form. The
family's config, which picks among the layers, is ``bspline.py``.

Outside the extended knot span every basis is zero, so the spline term vanishes and only the
SiLU base path remains; on the k extension intervals at either end the bases no longer sum to 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kan_models.base import LayerSplit
from kan_models.bspline_bases import adaptive_knots, bspline_basis, least_squares, uniform_knots


class BSplineKANLayer(nn.Module):
    """One KAN layer with Cox-de Boor B-spline activations on every edge."""

    knots: torch.Tensor  # a buffer: (in, G + 2k + 1)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        grid: int = 5,
        k: int = 3,
        grid_range: tuple[float, float] = (-1.0, 1.0),
        grid_eps: float = 0.02,
        noise_scale: float = 0.1,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.grid, self.k, self.grid_eps = grid, k, grid_eps
        self.register_buffer("knots", uniform_knots(grid, k, *grid_range, in_features).float())
        self.coef = nn.Parameter(torch.randn(out_features, in_features, grid + k) * noise_scale / math.sqrt(grid))
        bound = 1.0 / math.sqrt(in_features)
        self.scale_base = nn.Parameter(torch.empty(out_features, in_features).uniform_(-bound, bound))
        self.scale_spline = nn.Parameter(torch.full((out_features, in_features), bound))

    def basis(self, x: torch.Tensor) -> torch.Tensor:
        return bspline_basis(x, self.knots, self.k)

    def layer_split(self) -> LayerSplit:
        # Every parameter is (out, in[, G + k]); the knots are one row per input.
        return LayerSplit(
            outputs={"coef": 0, "scale_base": 0, "scale_spline": 0},
            inputs={"coef": 1, "scale_base": 1, "scale_spline": 1, "knots": 0},
        )

    def spline_weight(self) -> torch.Tensor:
        return self.coef * self.scale_spline.unsqueeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(F.silu(x), self.scale_base)
        spline = F.linear(self.basis(x).flatten(1), self.spline_weight().flatten(1))
        return base + spline

    @torch.no_grad()
    def update_grid(self, x: torch.Tensor) -> None:
        """Move the knots to the distribution of x (batch, in) and refit ``coef`` by least
        squares so each edge's spline changes as little as possible on x."""
        old_curves = torch.einsum("bij,oij->ibo", self.basis(x), self.coef)  # (in, batch, out)
        self.knots.copy_(self.refit_knots(x))
        new_basis = self.basis(x).permute(1, 0, 2)  # (in, batch, G + k)
        self.coef.copy_(least_squares(new_basis, old_curves).permute(2, 0, 1))

    def refit_knots(self, x: torch.Tensor) -> torch.Tensor:
        """The knots a grid update moves to: pykan's ``grid_eps`` mix of uniform and quantiles."""
        return adaptive_knots(x, self.grid, self.k, self.grid_eps)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, grid={self.grid}, k={self.k}"
