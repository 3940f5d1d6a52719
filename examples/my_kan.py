"""A user's own KAN, in the style of efficient-kan: each layer adds a linear map of SiLU(x) and
a learned combination of B-spline bases of x on a fixed grid. Written for kanscale's example
(docs/models.md, "Your own model"); kanscale knows nothing of it but the factory below.

    model: {family: custom, widths: [64, 10], factory: "examples/my_kan.py:build", options: {hidden: [32]}}
"""

from itertools import pairwise

import torch
from torch import nn


class SplineLinear(nn.Module):
    """One KAN layer: out_j = sum_i w_ji * silu(x_i) + sum_i sum_b c_jib * B_b(x_i)."""

    def __init__(self, inputs: int, outputs: int, grid: int = 5, order: int = 3, span: float = 3.0) -> None:
        super().__init__()
        step = 2 * span / grid
        knots = torch.arange(-order, grid + order + 1, dtype=torch.float32) * step - span
        self.register_buffer("knots", knots)  # grid + 2 * order + 1 knots, uniform
        self.order = order
        self.base = nn.Linear(inputs, outputs, bias=False)
        self.spline = nn.Parameter(torch.randn(outputs, inputs, grid + order) * 0.1 / grid**0.5)

    def bases(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, inputs) -> (batch, inputs, grid + order): Cox-de Boor's recursion."""
        t, x = self.knots, x.unsqueeze(-1)
        b = ((x >= t[:-1]) & (x < t[1:])).to(x.dtype)
        for k in range(1, self.order + 1):
            b = (x - t[: -(k + 1)]) / (t[k:-1] - t[: -(k + 1)]) * b[..., :-1] + (t[k + 1 :] - x) / (
                t[k + 1 :] - t[1:-k]
            ) * b[..., 1:]
        return b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(nn.functional.silu(x)) + torch.einsum("bik,oik->bo", self.bases(x), self.spline)


class MyKAN(nn.Module):
    def __init__(self, widths: list[int], grid: int, order: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SplineLinear(a, b, grid, order) for a, b in pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(widths: list[int], hidden: list[int] = (32,), grid: int = 5, order: int = 3) -> MyKAN:
    """``widths`` is model.widths, which kanscale passes to a factory that names it: the input and
    output widths the task is checked against; ``hidden`` the widths of the layers between them."""
    if len(widths) != 2:
        raise ValueError(f"model.widths {widths}: give [inputs, outputs]; the hidden widths go in model.options.hidden")
    return MyKAN([widths[0], *hidden, widths[1]], grid, order)
