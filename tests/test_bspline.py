"""B-spline bases and the grid update of the reference B-spline layer."""

import pytest
import torch

from kan_models.bspline_bases import bspline_basis, uniform_knots
from kan_models.bspline_reference import BSplineKANLayer


def cox_de_boor(x: float, t: list[float], j: int, k: int) -> float:
    """Textbook scalar recursion, written independently of the vectorised one."""
    if k == 0:
        return 1.0 if t[j] <= x < t[j + 1] else 0.0
    left = 0.0 if t[j + k] == t[j] else (x - t[j]) / (t[j + k] - t[j]) * cox_de_boor(x, t, j, k - 1)
    right = (
        0.0
        if t[j + k + 1] == t[j + 1]
        else (t[j + k + 1] - x) / (t[j + k + 1] - t[j + 1]) * cox_de_boor(x, t, j + 1, k - 1)
    )
    return left + right


@pytest.mark.parametrize("grid,k", [(1, 1), (5, 2), (10, 3), (7, 5)])
def test_partition_of_unity_inside_grid(grid, k):
    knots = uniform_knots(grid, k, -2.0, 3.0, in_features=3)
    x = torch.linspace(-2.0, 3.0, 301, dtype=torch.float64).unsqueeze(1).expand(-1, 3)
    sums = bspline_basis(x, knots, k).sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-12, rtol=0)


def test_bases_vanish_outside_extended_grid_and_are_partial_on_its_edges():
    grid, k = 4, 3
    knots = uniform_knots(grid, k, -1.0, 1.0, in_features=1)
    outside = torch.tensor([[-3.0], [2.5]], dtype=torch.float64)
    assert bspline_basis(outside, knots, k).abs().max() == 0
    edge = torch.tensor([[-1.2]], dtype=torch.float64)  # inside the k extension intervals
    assert 0 < bspline_basis(edge, knots, k).sum() < 1


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_matches_scalar_cox_de_boor(k):
    gen = torch.Generator().manual_seed(k)
    # a non-uniform knot vector, as the grid update produces
    knots = torch.sort(torch.rand(1, 6 + 2 * k + 1, generator=gen, dtype=torch.float64) * 4 - 2).values
    x = torch.rand(50, 1, generator=gen, dtype=torch.float64) * 5 - 2.5
    got = bspline_basis(x, knots, k)[:, 0, :]
    t = knots[0].tolist()
    want = torch.tensor(
        [[cox_de_boor(float(xi), t, j, k) for j in range(len(t) - k - 1)] for xi in x[:, 0]], dtype=torch.float64
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_grid_update_keeps_outputs_close_on_the_data():
    torch.manual_seed(0)
    layer = BSplineKANLayer(3, 4, grid=8, k=3, grid_range=(-1.0, 1.0)).double()
    with torch.no_grad():  # a trained-looking, smooth spline
        layer.coef.copy_(
            torch.sin(torch.linspace(0, 3, 11, dtype=torch.float64)).expand(4, 3, 11) * torch.rand(4, 3, 1)
        )
    x = (torch.randn(2000, 3, dtype=torch.float64) * 0.4).clamp(-0.95, 0.95)
    before = layer(x)
    old_knots = layer.knots.clone()
    layer.update_grid(x)
    after = layer(x)
    assert not torch.equal(old_knots, layer.knots), "the grid did not move"
    assert layer.knots[:, 3].max() <= x.min(0).values.max() + 1e-6  # grid now starts at the data
    rel = (after - before).norm() / before.norm()
    assert rel < 1e-2, f"outputs moved by {rel:.2e} relative"


def test_grid_update_moves_knots_to_data_outside_the_initial_range():
    torch.manual_seed(1)
    layer = BSplineKANLayer(2, 1, grid=5, k=3, grid_range=(-1.0, 1.0))
    x = torch.rand(500, 2) * 6 - 3  # data on [-3, 3], outside the initial grid
    layer.update_grid(x)
    inner = layer.knots[:, 3:-3]
    assert torch.all(inner[:, 0] <= -2.9) and torch.all(inner[:, -1] >= 2.9)
    assert torch.all(layer.knots.diff(dim=1) > 0)
