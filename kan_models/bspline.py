"""B-spline KAN (Liu et al. 2024): every edge i -> o carries its own learnable activation

    phi_oi(x) = scale_base[o, i] * silu(x) + scale_spline[o, i] * sum_j coef[o, i, j] * B_j(x)

where B_j are the G + k B-spline bases of order k on a grid of G intervals over ``grid_range``,
extended by k knots on either side. This module is the straightforward Cox-de Boor
implementation most KAN libraries use, kept as the reference (``impl: reference``); the default
``impl: fast`` layer in ``bspline_fast.py`` computes the same function in closed form.

Outside the extended knot span every basis is zero, so the spline term vanishes and only the
SiLU base path remains; on the k extension intervals at either end the bases no longer sum to 1.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kan_models.base import Interval, LayerSplit, LayerStack, ModelConfig


def uniform_knots(
    grid: int, k: int, low: float | torch.Tensor, high: float | torch.Tensor, in_features: int
) -> torch.Tensor:
    """Knots t_0 .. t_{G+2k} of a uniform grid over [low, high] extended by k knots per side,
    one row per input feature: shape (in_features, G + 2k + 1). ``low`` and ``high`` are numbers
    (one grid for all features) or tensors of shape (in_features,) (one grid per feature); the
    knots are computed in float64 so every dtype gets them rounded once."""
    low = torch.as_tensor(low, dtype=torch.float64).reshape(-1, 1)
    high = torch.as_tensor(high, dtype=torch.float64).reshape(-1, 1)
    h = (high - low) / grid
    knots = low + h * torch.arange(-k, grid + k + 1, dtype=torch.float64, device=low.device)
    return knots.expand(in_features, -1).contiguous()


def bspline_basis(x: torch.Tensor, knots: torch.Tensor, k: int) -> torch.Tensor:
    """All G + k B-spline bases of order k at x by the Cox-de Boor recursion.

    x: (batch, in); knots: (in, G + 2k + 1), non-decreasing per row. Returns (batch, in, G + k).
    """
    x = x.unsqueeze(-1)
    t = knots.unsqueeze(0)
    bases = ((x >= t[..., :-1]) & (x < t[..., 1:])).to(x.dtype)
    for p in range(1, k + 1):
        left = (x - t[..., : -(p + 1)]) / (t[..., p:-1] - t[..., : -(p + 1)]) * bases[..., :-1]
        right = (t[..., p + 1 :] - x) / (t[..., p + 1 :] - t[..., 1:-p]) * bases[..., 1:]
        bases = left + right
    return bases


def observed_span(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature lowest value and span (high - low) of x (batch, in); a feature with (almost)
    no spread gets a small positive span, since the knots built on it must strictly increase."""
    low, high = torch.aminmax(x, dim=0)
    return low, torch.clamp(high - low, min=1e-4 * torch.clamp(high.abs(), min=1.0))


def adaptive_knots(x: torch.Tensor, grid: int, k: int, grid_eps: float) -> torch.Tensor:
    """Knots refitted to the data in x (batch, in): ``grid_eps`` mixes a uniform grid over each
    feature's observed range (1.0) with one placed at the data's quantiles (0.0), as in pykan.
    Returns (in, G + 2k + 1)."""
    x_sorted = torch.sort(x, dim=0).values
    n = x_sorted.shape[0]
    quantile_idx = torch.linspace(0, n - 1, grid + 1, device=x.device).round().long()
    quantile_grid = x_sorted[quantile_idx]  # (G + 1, in)
    low, span = observed_span(x)
    step = span / grid
    uniform_grid = low + step * torch.arange(grid + 1, device=x.device, dtype=x.dtype).unsqueeze(1)
    inner = grid_eps * uniform_grid + (1.0 - grid_eps) * quantile_grid
    # Quantile knots coincide on repeated values; a tiny ramp keeps them strictly increasing.
    inner = inner + 1e-6 * step * torch.arange(grid + 1, device=x.device, dtype=x.dtype).unsqueeze(1)
    ext = torch.arange(1, k + 1, device=x.device, dtype=x.dtype).unsqueeze(1) * step
    knots = torch.cat([inner[:1] - ext.flip(0), inner, inner[-1:] + ext], dim=0)
    return knots.T.contiguous()


class BSplineKANLayer(nn.Module):
    """One KAN layer with Cox-de Boor B-spline activations on every edge."""

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


def least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched min ||a x - b||; solved in float64 for accuracy, returned in b's dtype.
    The CPU driver handles rank-deficient systems (fewer samples than bases)."""
    driver = "gelsd" if a.device.type == "cpu" else None
    solution = torch.linalg.lstsq(a.double(), b.double(), driver=driver).solution
    return solution.to(b.dtype)


# Where impl: auto runs the fused op: on CPUs it beat the fast layer at every size measured
# (docs/performance.md, "The fused layer"); its Triton kernel is not measured on a GPU yet.
AUTO_FUSED_ON = ("cpu",)


def fused_unavailable() -> str | None:
    """Why the fused op cannot be built here, or None (kan_models.fused, imported only when asked)."""
    from kan_models.fused import fused_unavailable as why

    return why()


def auto_impl(device_type: str) -> str:
    """What impl: auto runs on a device type, and why (the record's model.machine_choices)."""
    if device_type not in AUTO_FUSED_ON:
        return f"fast: the fused op is measured faster on {', '.join(AUTO_FUSED_ON)} only, not on {device_type}"
    if reason := fused_unavailable():
        return f"fast: {reason}"
    return f"fused: the fused op is built here and measured faster than fast on {device_type}"


class BSplineConfig(ModelConfig):
    """B-spline KAN: SiLU base path plus an order-k spline on a G-interval grid per edge."""

    family: Literal["bspline"]
    identity: ClassVar[tuple[str, ...]] = ("grid", "k")
    resolution: ClassVar[dict[str, str]] = {"grid": "grid", "order": "k"}
    grid: int = Field(5, ge=1, le=1000, description="number of grid intervals G")
    k: int = Field(3, ge=1, le=5, description="spline order")
    grid_range: Interval = Field((-1.0, 1.0), description="initial grid [low, high]")
    grid_eps: float = Field(0.02, ge=0.0, le=1.0, description="grid update: 1 = uniform, 0 = quantiles")
    noise_scale: float = Field(0.1, ge=0.0, description="std of the initial spline coefficients, times 1/sqrt(G)")
    impl: Literal["fast", "reference", "fused", "auto"] = Field(
        "fast",
        description="fast: closed-form bases on the uniform grid, lean backward (grid update stays "
        "uniform, grid_eps unused); reference: Cox-de Boor over all bases, grid_eps grid updates; fused: the fast "
        "layer's function in one op that never forms the basis tensor (CPUs: C++, built once per machine, needs a C++ "
        "compiler; CUDA GPUs: Triton kernels, need triton); auto: fused on CPUs where a C++ compiler builds it "
        "(measured faster there), fast elsewhere",
    )
    product: Literal["auto", "dense", "sparse"] = Field(
        "auto",
        description="how the fast layer multiplies its bases with the coefficients: dense (one GEMM over all "
        "G + k bases), sparse (CSR over the k + 1 non-zero ones), auto: sparse on CPUs from this CPU's measured crossover "
        "in bases per non-zero one (scripts/bench_sparse_crossover.py --save; 20 where none is measured)",
    )

    @model_validator(mode="after")
    def _product_needs_fast(self) -> BSplineConfig:
        if self.product != "auto" and self.impl not in ("fast", "auto"):
            raise ValueError(f"product {self.product} is a choice of the fast layer; set impl=fast or product=auto")
        if self.impl == "fused":
            if reason := fused_unavailable():
                raise ValueError(f"impl fused cannot be built here: {reason}; set impl=fast")
        return self

    def machine_choices(self, device_type: str) -> dict[str, str]:
        if self.impl == "auto":
            return {"impl": auto_impl(device_type)}
        if self.impl != "fast" or self.product != "auto":
            return {}
        from kan_models.bspline_fast import use_sparse
        from kan_models.sparse_crossover import cpu_crossover

        bases = (self.grid + self.k) / (self.k + 1)
        chosen = "sparse" if use_sparse("auto", self.grid + self.k, self.k, torch.device(device_type)) else "dense"
        why = (
            f"{bases:.1f} bases per non-zero against a crossover of {cpu_crossover().describe()}"
            if device_type == "cpu"
            else f"no crossover is measured on {device_type}"
        )
        return {"product": f"{chosen}: {why}"}

    def build(self) -> LayerStack:
        from kan_models.bspline_fast import FastBSplineKANLayer  # it builds on this module

        if self.impl == "fast" or (self.impl == "auto" and fused_unavailable()):
            layer = functools.partial(FastBSplineKANLayer, product=self.product)
        elif self.impl in ("fused", "auto"):
            from kan_models.fused import FusedBSplineKANLayer

            fused_on = None if self.impl == "fused" else AUTO_FUSED_ON
            layer = functools.partial(FusedBSplineKANLayer, product=self.product, fused_on=fused_on)
        else:
            layer = BSplineKANLayer
        return LayerStack(
            [
                layer(i, o, self.grid, self.k, self.grid_range, self.grid_eps, self.noise_scale)
                for i, o in zip(self.widths[:-1], self.widths[1:])
            ]
        )
