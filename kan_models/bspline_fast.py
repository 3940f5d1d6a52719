"""Fast B-spline KAN layer for uniform grids (``impl: fast``, the default).

On a uniform knot vector t_j = t_0 + j h every B-spline basis of order k is a shifted copy of
one piecewise polynomial. An input x lies in cell c = floor(u), u = (x - t_0) / h; only the
k + 1 bases B_{c-k} .. B_c are non-zero there, and they are fixed polynomials of the local
coordinate r = u - c in [0, 1):

    B_{c-k+m}(x) = sum_a r^a M[a, m]            m = 0..k
    B'_{c-k+m}(x) = sum_a a r^(a-1) M[a, m] / h

M is the (k + 1) x (k + 1) uniform B-spline basis matrix (k = 3: (1 - r)^3 / 6,
(3r^3 - 6r^2 + 4) / 6, (-3r^3 + 3r^2 + 3r + 1) / 6, r^3 / 6), derived exactly once per k. So the
bases cost k + 1 polynomial evaluations per input instead of the Cox-de Boor recursion over all
G + k bases and k levels.

The k + 1 values are scattered into a dense (batch, in, G + k) block for one matrix product with
the coefficients, plus the SiLU base path. The GEMM does (G + k) / (k + 1) times the arithmetic
that is needed, and still wins on a CPU while that is small: sparse products (CSR) run far below
the dense rate. Past the machine's crossover in bases per non-zero (measured where it runs:
kan_models/sparse_crossover.py) the layer keeps the k + 1 values as a CSR matrix instead, for the
forward product, the weight gradient and the input gradient (a sampled product). A custom autograd
function saves only its inputs: backward recomputes the local bases (cheap) instead of keeping the
(batch, in, G + k) basis and the recursion's intermediates alive between forward and backward.

Under torch.compile the layer runs a second, branch-free form instead (see
:func:`pointwise_forward`): every basis is the centred cardinal B-spline of its distance to the
input, a few fused multiply-adds per (input, basis) that inductor turns into one vectorised loop,
where the scatter and gather of the local form become slow scalar loops.

Outside the grid both behave like the reference: the spline term is zero outside the extended
span [t_0, t_{G+2k}), partial on the k extension cells at either end. For k >= 2 value and slope
are continuous at knots, so how an input exactly on a knot rounds into a cell does not matter.
For k = 1 the slope jumps at knots; the eager layer then checks the cell against the stored knots,
so that the x-gradient on a knot is the reference's right-hand one, while the compiled form takes
whichever side the rounding of u picks.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kan_models.bspline_bases import basis_matrix, observed_span, uniform_knots
from kan_models.bspline_reference import BSplineKANLayer
from kan_models.sparse_crossover import cpu_crossover


def _horner(rows: tuple[tuple[float, ...], ...], r: torch.Tensor) -> torch.Tensor:
    """sum_a rows[a][m] r^a for every m: r (batch, 1, in) -> (batch, k + 1, in); a constant
    polynomial (the slopes of k = 1) stays (k + 1, 1) and broadcasts."""
    coef = torch.tensor(rows, dtype=r.dtype, device=r.device).unsqueeze(-1)  # (degree + 1, k + 1, 1)
    acc = coef[-1]
    for a in range(len(rows) - 2, -1, -1):
        acc = torch.addcmul(coef[a], acc, r)
    return acc


def grid_coordinate(x: torch.Tensor, knots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """u = (x - t_0) / h, x's position in cells of its feature's uniform grid, and 1 / h."""
    t0 = knots[:, 0]
    inv_h = (knots.shape[1] - 1) / (knots[:, -1] - t0)
    return (x - t0) * inv_h, inv_h


class LocalBases(NamedTuple):
    """The k + 1 non-zero bases of every input, each (batch, in, k + 1). They are computed with
    the k + 1 axis in the middle, so that elementwise work runs along the long, contiguous ``in``
    axis, and returned as transposed views."""

    numbers: torch.Tensor  # long: the basis numbers j, clamped into [0, G + k)
    values: torch.Tensor  # B_j(x), zero where basis j does not exist (near and beyond the ends)
    slopes: torch.Tensor | None  # dB_j/dx, likewise


def local_bases(x: torch.Tensor, knots: torch.Tensor, k: int, derivative: bool = False) -> LocalBases:
    """x: (batch, in); knots: (in, G + 2k + 1), uniform per row."""
    n_cells = knots.shape[1] - 1  # G + 2k
    n_bases = n_cells - k
    u, inv_h = grid_coordinate(x, knots)
    # Far outside the grid every basis is zero; pinning u just outside keeps the cell numbers
    # representable (u = 1e30 or inf would overflow the integer index) and sends NaN there too.
    # The output still turns non-finite through the SiLU path, so a diverged run is detected.
    u = torch.nan_to_num(u.clamp(-k - 1.0, n_cells + 1.0), nan=-k - 1.0)
    cell = torch.floor(u)
    if k == 1:  # see the module docstring: take the stored knots' [t_c, t_c+1) at a knot
        at = cell.clamp(0, n_cells - 1).long()
        cell = cell - (x < knots.T.gather(0, at)).to(x.dtype) + (x >= knots.T.gather(0, at + 1)).to(x.dtype)
    r = (u - cell).unsqueeze(1)
    # Basis numbers in floating point (int64 arithmetic is several times slower on CPUs); a
    # number that clamping changes is out of range, its basis does not exist.
    number = cell.unsqueeze(1) + torch.arange(-k, 1, dtype=x.dtype, device=x.device).unsqueeze(-1)
    clamped = number.clamp(0, n_bases - 1)
    exists = clamped == number
    zero = x.new_zeros(())
    value_rows, slope_rows = basis_matrix(k)
    values = torch.where(exists, _horner(value_rows, r), zero)
    slopes = torch.where(exists, _horner(slope_rows, r) * inv_h, zero) if derivative else None
    return LocalBases(
        clamped.long().transpose(1, 2), values.transpose(1, 2), None if slopes is None else slopes.transpose(1, 2)
    )


def dense_bases(local: LocalBases, n_bases: int) -> torch.Tensor:
    """All bases, (batch, in, n_bases). Non-existent bases carry value zero but were clamped
    onto an edge basis number, hence scatter-add rather than scatter."""
    batch, n_in, _ = local.values.shape
    return local.values.new_zeros(batch, n_in, n_bases).scatter_add_(-1, local.numbers, local.values)


def sparse_bases(local: LocalBases, n_bases: int) -> torch.Tensor:
    """The same (batch, in * n_bases) matrix as :func:`dense_bases`, as CSR: each row holds its
    in * (k + 1) values in order (feature, basis), the clamped non-existent ones (value zero)
    included, so a row's column numbers never decrease and its values keep ``local``'s layout."""
    batch, n_in, width = local.values.shape
    columns = local.numbers + torch.arange(n_in, device=local.numbers.device).view(1, -1, 1) * n_bases
    rows = torch.arange(0, batch * n_in * width + 1, n_in * width, device=local.numbers.device)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": the tests check it
        warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
        # Valid by construction (rows of equal length, columns in order): no invariant checks.
        return torch.sparse_csr_tensor(
            rows, columns.reshape(-1), local.values.reshape(-1), size=(batch, n_in * n_bases), check_invariants=False
        )


def use_sparse(product: str, n_bases: int, k: int, device: torch.device, crossover: float | None = None) -> bool:
    """Whether the layer multiplies sparsely: as asked, or under ``auto`` on CPUs from
    ``crossover`` bases per non-zero (default: this machine's, kan_models/sparse_crossover.py). On
    CUDA the crossover is not measured yet, so CUDA stays dense unless asked (``product: sparse``)."""
    if product != "auto":
        return product == "sparse"
    crossover = cpu_crossover().bases_per_nonzero if crossover is None else crossover
    return device.type == "cpu" and n_bases / (k + 1) >= crossover


def spline_weight(coef: torch.Tensor, scale_spline: torch.Tensor) -> torch.Tensor:
    return coef * scale_spline.unsqueeze(-1)


# Elements per block of dense bases or weights: 8 MiB of float32. Blocks this small come from
# (and go back to) the allocator's heap and stay in cache; whole tensors of a wide layer (batch
# 1024, in 1024, out 1024, G + k = 13: 1024 x 1024 x 13 floats) are fresh memory mappings whose
# page faults cost more than the arithmetic on them.
BLOCK_ELEMENTS = 1 << 21


def blocks(n_rows: int, n_in: int, n_out: int, n_bases: int) -> list[tuple[slice, list[slice]]]:
    """(input features, [batch rows, ...]) blocks: an (out, features, G + k) slice of the weight
    and a (rows, features, G + k) slice of the dense bases each hold at most BLOCK_ELEMENTS."""
    in_step = max(1, min(n_in, BLOCK_ELEMENTS // (n_out * n_bases)))
    row_step = max(1, BLOCK_ELEMENTS // (in_step * n_bases))
    rows = [slice(r, r + row_step) for r in range(0, n_rows, row_step)]
    return [(slice(i, i + in_step), rows) for i in range(0, n_in, in_step)]


class FastBSplineFunction(torch.autograd.Function):
    """The layer's output silu(x) @ scale_base^T + bases(x) @ (coef * scale_spline)^T, computed
    block by block (see :func:`blocks`). Saves only its inputs (x and the parameters, which are
    alive anyway) and recomputes the bases, block by block, in backward."""

    @staticmethod
    def forward(x, knots, coef, scale_base, scale_spline, k, sparse=False):
        out = F.linear(F.silu(x), scale_base)
        n_out, n_in, n_bases = coef.shape
        for cols, row_blocks in blocks(len(x), n_in, n_out, n_bases):
            weight = spline_weight(coef[:, cols], scale_spline[:, cols]).flatten(1)
            for rows in row_blocks:
                local = local_bases(x[rows, cols], knots[cols], k)
                if sparse:
                    out[rows] += torch.sparse.mm(sparse_bases(local, n_bases), weight.T)
                else:
                    out[rows].addmm_(dense_bases(local, n_bases).flatten(1), weight.T)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, knots, coef, scale_base, scale_spline, k, sparse = inputs
        ctx.save_for_backward(x, knots, coef, scale_base, scale_spline)
        ctx.k, ctx.sparse = k, sparse

    @staticmethod
    def backward(ctx, grad_out):
        x, knots, coef, scale_base, scale_spline = ctx.saved_tensors
        need_x, _, need_coef, need_base, need_spline = ctx.needs_input_grad[:5]
        n_out, n_in, n_bases = coef.shape
        grad_x = x.new_empty(x.shape) if need_x else None
        grad_coef = coef.new_empty(coef.shape) if need_coef else None
        grad_spline = scale_spline.new_empty(scale_spline.shape) if need_spline else None
        for cols, row_blocks in blocks(len(x), n_in, n_out, n_bases):
            n_cols = len(range(n_in)[cols])
            weight = spline_weight(coef[:, cols], scale_spline[:, cols]).flatten(1) if need_x else None
            # d loss / d (coef * scale_spline) for this block of input features
            grad_weight = coef.new_zeros(n_out, n_cols * n_bases) if need_coef or need_spline else None
            for rows in row_blocks:
                local = local_bases(x[rows, cols], knots[cols], ctx.k, derivative=need_x)
                bases = sparse_bases(local, n_bases) if ctx.sparse else dense_bases(local, n_bases).flatten(1)
                if grad_weight is not None and ctx.sparse:
                    grad_weight += torch.sparse.mm(bases.t(), grad_out[rows]).T
                elif grad_weight is not None:
                    grad_weight.addmm_(grad_out[rows].T, bases)
                if need_x:  # d loss / d B_j(x_i), for the k + 1 bases j each input touches
                    if ctx.sparse:
                        touched = torch.sparse.sampled_addmm(bases, grad_out[rows], weight, beta=0.0).values()
                    else:
                        touched = (grad_out[rows] @ weight).view(-1, n_cols, n_bases).gather(-1, local.numbers)
                    grad_x[rows, cols] = (touched.view(local.slopes.shape) * local.slopes).sum(-1)
            if grad_weight is not None:
                grad_weight = grad_weight.view(n_out, n_cols, n_bases)
            if need_spline:
                grad_spline[:, cols] = (grad_weight * coef[:, cols]).sum(-1)
            if need_coef:
                grad_coef[:, cols] = grad_weight * scale_spline[:, cols].unsqueeze(-1)
        grad_base = grad_out.T @ F.silu(x) if need_base else None
        if need_x:
            sig = torch.sigmoid(x)  # silu' = sig (1 + x (1 - sig)), in ops that support double backward
            grad_x = grad_x + (grad_out @ scale_base) * sig * (1 + x * (1 - sig))
        return grad_x, None, grad_coef, grad_base, grad_spline, None, None


def cardinal_terms(k: int) -> tuple[tuple[float, float], ...]:
    """(a_l, c_l) with B(t) = sum_l c_l max(a_l - |t|, 0)^k the order-k cardinal B-spline
    centred at 0 (support |t| < (k + 1) / 2, in cells): the truncated-power form
    sum_l (-1)^l C(k + 1, l) (s - l)_+^k / k!, folded about the centre so that only the terms
    with a_l = (k + 1) / 2 - l > 0 remain and no large terms cancel."""
    half = (k + 1) / 2
    return tuple(
        (half - term, (-1) ** term * math.comb(k + 1, term) / math.factorial(k))
        for term in range(k + 1)
        if half - term > 0
    )


def pointwise_forward(
    x: torch.Tensor,
    knots: torch.Tensor,
    coef: torch.Tensor,
    scale_base: torch.Tensor,
    scale_spline: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """The layer's output with every basis evaluated in closed form, for torch.compile, whose
    autograd derives the backward (its partitioner chooses to recompute the bases from x or to
    save them). Basis axis in the middle, (batch, G + k, in), so the fused loop runs along ``in``."""
    u, _ = grid_coordinate(x, knots)
    half = (k + 1) / 2
    centres = torch.arange(coef.shape[-1], dtype=x.dtype, device=x.device).unsqueeze(-1) + half
    t = u.unsqueeze(1) - centres  # distance to the centre of basis j, in cells
    if k == 1:
        # The slope jumps at knots: |t| written with slope +1 at 0, clamp (whose gradient passes
        # at the bound) rather than relu, and the support half-open as the reference's, so that
        # the slopes on knots are the right-hand ones.
        hat = (1 - torch.where(t >= 0, t, -t)).clamp(min=0)
        bases = torch.where((t >= -half) & (t < half), hat, 0.0)
    else:  # value and slope are continuous (zero at the support's ends): the plain form
        distance = t.abs()
        bases = functools.reduce(operator.add, (c * (a - distance).clamp(min=0) ** k for a, c in cardinal_terms(k)))
    weight = spline_weight(coef, scale_spline).transpose(1, 2).flatten(1)  # (out, (G + k) * in)
    return torch.addmm(F.linear(F.silu(x), scale_base), bases.flatten(1), weight.T)


def is_uniform(knots: torch.Tensor) -> bool:
    """Whether every row of a knot vector is evenly spaced, up to the rounding of its dtype
    (and the 1e-6 relative ramp ``adaptive_knots`` adds even at grid_eps = 1)."""
    steps = knots.diff(dim=1)
    mean = steps.mean(dim=1, keepdim=True)
    rounding = 16 * torch.finfo(knots.dtype).eps * knots.abs().amax(dim=1, keepdim=True)
    return bool(torch.all(steps > 0) and torch.all((steps - mean).abs() <= rounding + 1e-5 * mean))


class FastBSplineKANLayer(BSplineKANLayer):
    """The B-spline KAN layer of :class:`BSplineKANLayer` (same parameters, buffers and state
    dict) computed in closed form on its uniform grid. Its grid update refits to a uniform grid
    over the data's range (pykan's grid_eps = 1), whatever ``grid_eps`` says."""

    def __init__(self, *args, product: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.product = product  # dense, sparse, or auto: by size (:func:`use_sparse`)
        # read once here: a file read inside forward would break the compiled graph
        self.crossover = cpu_crossover().bases_per_nonzero
        self.register_load_state_dict_pre_hook(_refuse_non_uniform_knots)

    def basis(self, x: torch.Tensor) -> torch.Tensor:
        return dense_bases(local_bases(x, self.knots, self.k), self.coef.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One dtype for every operand: autocast's where it is on (it does not reach into a custom
        # autograd function), else the parameters' (FSDP and DeepSpeed hand them over in bf16 with
        # the knots, a buffer, still in float32). The casts are differentiable, as autocast's are.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.coef.dtype
        args = (
            x.to(dtype),
            self.knots.to(dtype),
            self.coef.to(dtype),
            self.scale_base.to(dtype),
            self.scale_spline.to(dtype),
            self.k,
        )
        sparse = use_sparse(self.product, self.coef.shape[-1], self.k, x.device, self.crossover)
        if torch.compiler.is_compiling() and not sparse:
            if len(x) * self.in_features * self.coef.shape[-1] > BLOCK_ELEMENTS:
                # Bases too large to keep: recompute them in backward rather than let Inductor save
                # them; the wide model's step takes as long and saves a small fraction of the memory,
                # while small bases are kept, as recomputing them costs a large share of a small
                # model's step (docs/models.md).
                return checkpoint(pointwise_forward, *args, use_reentrant=False)
            return pointwise_forward(*args)
        return eager_layer(*args, sparse)

    def refit_knots(self, x: torch.Tensor) -> torch.Tensor:
        low, span = observed_span(x)
        return uniform_knots(self.grid, self.k, low, low + span, self.in_features)


def uncompiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` run eagerly under torch.compile (torch.compiler.disable), applied at its first call:
    the decorator imports TorchDynamo, which at import time would add a second to the start of
    every process that imports the models, compiled or not."""
    disabled: Callable[..., torch.Tensor] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any) -> torch.Tensor:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args)

    return wrapper


@uncompiled  # CSR products do not compile: under torch.compile a sparse layer runs eagerly
def eager_layer(
    x: torch.Tensor,
    knots: torch.Tensor,
    coef: torch.Tensor,
    scale_base: torch.Tensor,
    scale_spline: torch.Tensor,
    k: int,
    sparse: bool,
) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return FastBSplineFunction.apply(x, knots, coef, scale_base, scale_spline, k, sparse)


def _refuse_non_uniform_knots(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """A reference layer's knots after a grid update with grid_eps < 1 are not uniform; the fast
    layer would silently evaluate a different spline on them."""
    knots = state_dict.get(prefix + "knots")
    if knots is not None and not is_uniform(knots):
        error_msgs.append(
            f"{prefix}knots are not uniform (a grid update with grid_eps < 1?); the fast "
            "B-spline layer needs uniform knots: load this state into model.impl=reference"
        )
