"""What every B-spline layer shares, below them all: the knots of a grid (uniform, or refitted to
data), the bases of the Cox-de Boor recursion, the uniform basis matrix of the closed-form layers,
and the least-squares refit of a grid update. The reference layer (``bspline_reference.py``), the
fast layer (``bspline_fast.py``) and the fused op (``fused/``) build on this module; it imports
none of them.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

import torch


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


def least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched min ||a x - b||; solved in float64 for accuracy, returned in b's dtype.
    The CPU driver handles rank-deficient systems (fewer samples than bases)."""
    driver = "gelsd" if a.device.type == "cpu" else None
    solution = torch.linalg.lstsq(a.double(), b.double(), driver=driver).solution
    return solution.to(b.dtype)


@cache
def basis_matrix(k: int) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """(M, M'): M[a][m] is the coefficient of r^a in B_{c-k+m}, M'[a][m] = (a + 1) M[a + 1][m]
    that of r^a in its derivative (in units of 1/h).

    Derived in exact rational arithmetic from the uniform Cox-de Boor step: at order p,
    B_{c-p+m} = ((r + p - m) B_{c-p+m} + (m + 1 - r) B_{c-p+1+m}) / p over order p - 1."""
    polys = [[Fraction(1)]]  # order 0: the one basis of the cell is 1
    for p in range(1, k + 1):
        new = []
        for m in range(p + 1):
            acc = [Fraction(0)] * (p + 1)
            if m >= 1:  # (r + p - m) * previous[m - 1]
                for a, c in enumerate(polys[m - 1]):
                    acc[a] += c * (p - m)
                    acc[a + 1] += c
            if m < p:  # (m + 1 - r) * previous[m]
                for a, c in enumerate(polys[m]):
                    acc[a] += c * (m + 1)
                    acc[a + 1] -= c
            new.append([c / p for c in acc])
        polys = new
    value = tuple(tuple(float(polys[m][a]) for m in range(k + 1)) for a in range(k + 1))
    slope = tuple(tuple(float((a + 1) * polys[m][a + 1]) for m in range(k + 1)) for a in range(k))
    return value, slope
