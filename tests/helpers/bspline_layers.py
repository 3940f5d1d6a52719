"""What the B-spline layer tests share: a reference layer with parameters of order 1 on every path,
the points it is probed at (inside the grid, on every knot, beside and far outside the extended
span), its output with every gradient, and the fused layer holding the same state."""

import torch

from kan_models.bspline_bases import uniform_knots
from kan_models.bspline_reference import BSplineKANLayer
from kan_models.fused import FusedBSplineKANLayer

LOW, HIGH = -1.0, 2.0
GRADIENTS = ["output", "d/dx", "d/dcoef", "d/dscale_base", "d/dscale_spline"]


def reference_layer(grid: int, k: int, dtype: torch.dtype) -> BSplineKANLayer:
    torch.manual_seed(grid * 10 + k)
    layer = BSplineKANLayer(3, 4, grid, k, (LOW, HIGH)).to(dtype)
    with torch.no_grad():  # random parameters of order 1 on every path, and knots exact in dtype
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
        layer.knots.copy_(uniform_knots(grid, k, LOW, HIGH, 3))
    return layer


def probe_points(layer: BSplineKANLayer, dtype: torch.dtype) -> torch.Tensor:
    """Inside the grid, on every knot (both ends of the extended span included), just beside
    the span's ends, and far outside; one column per input feature."""
    knots = layer.knots[0]
    tiny = 1e-3 * float(knots[1] - knots[0])
    inside = torch.linspace(LOW, HIGH, 41, dtype=dtype)[1:-1] + 0.0123
    edges = torch.tensor([knots[0] - tiny, knots[-1] - tiny, knots[-1] + tiny, -100.0, 100.0], dtype=dtype)
    points = torch.cat([inside, knots.to(dtype), edges])
    return torch.stack([points, points.flip(0), points.roll(7)], dim=1)


def outputs_and_grads(forward, layer: BSplineKANLayer, x: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of x and of every parameter, for a fixed cotangent."""
    x = x.clone().requires_grad_()
    y = forward(x)
    cotangent = torch.cos(torch.arange(y.numel(), dtype=y.dtype, device=y.device)).view_as(y)
    return [y, *torch.autograd.grad(y, [x, layer.coef, layer.scale_base, layer.scale_spline], cotangent)]


def fused_like(ref: BSplineKANLayer) -> FusedBSplineKANLayer:
    fused = FusedBSplineKANLayer(ref.in_features, ref.out_features, ref.grid, ref.k, (LOW, HIGH)).to(ref.coef.dtype)
    fused.load_state_dict(ref.state_dict())
    return fused


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """Each of :func:`outputs_and_grads`' tensors' largest error, relative to the largest value."""
    return {
        n: float((g.detach().double() - w.detach().double()).abs().max() / w.detach().double().abs().max())
        for n, g, w in zip(GRADIENTS, got, want, strict=True)
    }
