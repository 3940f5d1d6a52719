"""The fused B-spline op's GPU kernels, in Triton: the same three computations as the C++ op
(``csrc/forward.cpp``, ``csrc/backward.cpp``) with the same arguments and results, so :func:`forward` and
:func:`backward` are drop-in replacements for ``extension().forward`` / ``.backward`` on CUDA
tensors (``kan_models/fused/__init__.py`` chooses between them by the tensors' device).

Per input only its k + 1 non-zero bases are evaluated, in registers, by Horner's rule in the
local coordinate r of its cell, as the C++ op does; the (batch, in, G + k) basis tensor is never
formed. k is a ``tl.constexpr``: the loops over the bases and over the polynomial's powers unroll.

    forward   out[b, o]    = sum_i sum_m B_m(x[b, i]) w[i, first + m, o]   program: (rows, outputs)
    grad_w    gw[i, j, o] += B_m(x[b, i]) grad[b, o]     (atomic adds)     program: (rows, outputs)
    grad_x    gx[b, i]     = sum_m B'_m(x[b, i]) <w[i, first + m, :], grad[b, :]>  program: (rows, input)

This module imports triton at its top: import it only where a CUDA tensor needs it (the package
imports it lazily), so a machine without triton still imports ``kan_models.fused``. Its tests run
these kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors
(tests/test_bspline_triton.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

MAX_ORDER = 8  # k <= 7, as the C++ op (kMaxOrder): the model accepts k 1-5

# Tiles of 32 rows x 64 outputs: a guess, not tuned on any GPU yet. No autotuning:
# it would time candidates on the first call of every shape, and the interpreter cannot time.
BLOCK_ROWS = 32
BLOCK_OUTPUTS = 64


@triton.jit
def _locate(x, knots_row, n_knots, K: tl.constexpr):
    """(first basis number, local coordinate r in [0, 1), 1 / h) of every x on one input's uniform
    grid, as ``Bases::compute`` in csrc/bases.h: u clamped to [-k - 1, n_cells + 1], NaN to the low
    end, and for k = 1 the cell of the stored knots at a knot (the reference's right-hand slope)."""
    dt = x.dtype
    t0 = tl.load(knots_row).to(dt)
    n_cells = (n_knots - 1).to(dt)
    inv_h = n_cells / (tl.load(knots_row + n_knots - 1).to(dt) - t0)
    u = (x - t0) * inv_h
    low = -K - 1.0
    u = tl.where(u != u, low, u)  # NaN: below the grid, where every basis is zero
    u = tl.where(u < low, low, u)
    u = tl.where(u > n_cells + 1.0, n_cells + 1.0, u)
    cell = tl.floor(u)
    if K == 1:  # the slope jumps at knots: take the cell the stored knots say x lies in
        at = tl.minimum(tl.maximum(cell.to(tl.int32), 0), n_knots - 2)
        left = tl.load(knots_row + at).to(dt)
        right = tl.load(knots_row + at + 1).to(dt)
        cell = cell - tl.where(x < left, 1.0, 0.0).to(dt) + tl.where(x >= right, 1.0, 0.0).to(dt)
    # r from the cell's stored knot, not u - cell: in float32, u's rounding grows with the cell's
    # number (at large grids r, and so the bases and gradients, lose several times the reference's
    # float32 accuracy); x - t_c is nearly exact and r < 1. Cells without a stored knot have no basis.
    c = cell.to(tl.int32)
    at = tl.minimum(tl.maximum(c, 0), n_knots - 1)
    r = tl.where(c == at, (x - tl.load(knots_row + at).to(dt)) * inv_h, u - cell)
    return c - K, r, inv_h


@triton.jit
def _horner(r, rows, m: tl.constexpr, DEGREE: tl.constexpr, K: tl.constexpr):
    """sum_a rows[a, m] r^a over a = 0..DEGREE (rows is (., K + 1) row-major): basis m's value
    (the value rows, DEGREE = K) or its slope in units of 1/h (the slope rows, DEGREE = K - 1)."""
    v = tl.zeros_like(r) + tl.load(rows + DEGREE * (K + 1) + m).to(r.dtype)
    for step in tl.static_range(DEGREE):
        v = v * r + tl.load(rows + (DEGREE - 1 - step) * (K + 1) + m).to(r.dtype)
    return v


@triton.jit
def _forward_kernel(
    x_ptr,
    knots_ptr,
    w_ptr,
    out_ptr,
    value_rows,
    batch,
    n_in,
    n_knots,
    n_bases,
    n_out,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_ok = rows < batch
    out_ok = outs < n_out
    # accumulated in the operands' dtype (float32 or float64), as the C++ op's tile
    acc = tl.zeros((BLOCK_B, BLOCK_O), dtype=out_ptr.dtype.element_ty)
    for i in range(n_in):
        x = tl.load(x_ptr + rows * n_in + i, mask=row_ok, other=0.0)
        first, r, _ = _locate(x, knots_ptr + i * n_knots, n_knots, K)
        slab = w_ptr + i * n_bases * n_out  # w[i]: (G + k) x out, read again by every row tile: L2
        for m in tl.static_range(K + 1):
            j = first + m
            ok = row_ok & (j >= 0) & (j < n_bases)  # bases past the span's ends do not exist
            weight = tl.load(slab + j[:, None] * n_out + outs[None, :], mask=ok[:, None] & out_ok[None, :], other=0.0)
            acc += _horner(r, value_rows, m, K, K)[:, None] * weight
    tl.store(out_ptr + rows[:, None] * n_out + outs[None, :], acc, mask=row_ok[:, None] & out_ok[None, :])


@triton.jit
def _grad_w_kernel(
    grad_ptr,
    x_ptr,
    knots_ptr,
    gw_ptr,
    value_rows,
    batch,
    n_in,
    n_knots,
    n_bases,
    n_out,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    # Atomic adds, not per-row-tile partial sums reduced afterwards: the row j a basis adds to
    # depends on the data, so a tile cannot sum its rows in registers without a dense one-hot over
    # all G + k bases (the work this op exists to avoid), and partials would take (batch / BLOCK_B)
    # x in x (G + k) x out floats (gigabytes for the wide workload's 1024 x 1024 layer). The price:
    # the order of the adds, and so the last bits of grad_w in float32, varies from run to run.
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_ok = rows < batch
    out_ok = outs < n_out
    grad = tl.load(
        grad_ptr + rows[:, None] * n_out + outs[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0
    )  # loaded once, used for every input and basis
    for i in range(n_in):
        x = tl.load(x_ptr + rows * n_in + i, mask=row_ok, other=0.0)
        first, r, _ = _locate(x, knots_ptr + i * n_knots, n_knots, K)
        slab = gw_ptr + i * n_bases * n_out
        for m in tl.static_range(K + 1):
            j = first + m
            ok = row_ok & (j >= 0) & (j < n_bases)
            # relaxed: no ordering with other memory is needed, only the sum (the default, acq_rel, fences)
            tl.atomic_add(
                slab + j[:, None] * n_out + outs[None, :],
                _horner(r, value_rows, m, K, K)[:, None] * grad,
                mask=ok[:, None] & out_ok[None, :],
                sem="relaxed",
            )


@triton.jit
def _grad_x_kernel(
    grad_ptr,
    x_ptr,
    knots_ptr,
    w_ptr,
    gx_ptr,
    slope_rows,
    batch,
    n_in,
    n_knots,
    n_bases,
    n_out,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    # One program per (row tile, input), looping over all outputs: each gx element is written by one
    # program, so no atomics, and the result does not depend on the order programs run in.
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    i = tl.program_id(1)
    row_ok = rows < batch
    x = tl.load(x_ptr + rows * n_in + i, mask=row_ok, other=0.0)
    first, r, inv_h = _locate(x, knots_ptr + i * n_knots, n_knots, K)
    slab = w_ptr + i * n_bases * n_out
    acc = tl.zeros((BLOCK_B,), dtype=gx_ptr.dtype.element_ty)
    for o0 in range(0, n_out, BLOCK_O):
        outs = o0 + tl.arange(0, BLOCK_O)
        out_ok = outs < n_out
        grad = tl.load(
            grad_ptr + rows[:, None] * n_out + outs[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0
        )
        for m in tl.static_range(K + 1):
            j = first + m
            ok = row_ok & (j >= 0) & (j < n_bases)
            weight = tl.load(slab + j[:, None] * n_out + outs[None, :], mask=ok[:, None] & out_ok[None, :], other=0.0)
            acc += _horner(r, slope_rows, m, K - 1, K) * inv_h * tl.sum(weight * grad, axis=1)
    tl.store(gx_ptr + rows * n_in + i, acc, mask=row_ok)


@functools.lru_cache(maxsize=64)
def _rows_on(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _device_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The polynomial rows on the operands' device and in their dtype, copied once per (k, device,
    dtype): the op hands them over as CPU float64, and a copy per call would be a synchronous
    host-to-device transfer in every step (and none is allowed inside a CUDA graph)."""
    return _rows_on(tuple(rows.flatten().tolist()), like.device, like.dtype)


def _on_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """The tensors' GPU as the current one while launching: Triton launches on the current device's
    stream, which under a launcher that never set it is GPU 0 whatever the tensors' device. (The
    interpreter's CPU tensors need nothing.)"""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _check(x: torch.Tensor, knots: torch.Tensor, w: torch.Tensor, k: int) -> None:
    """The C++ op's checks, with its error type (RuntimeError)."""
    if not 1 <= k < MAX_ORDER:
        raise RuntimeError(f"fused B-spline: k must be 1-{MAX_ORDER - 1}")
    if x.dtype not in (torch.float32, torch.float64) or knots.dtype != x.dtype or w.dtype != x.dtype:
        raise RuntimeError(
            f"fused B-spline (Triton): x, knots and w must be one dtype, float32 or float64; got "
            f"{x.dtype}, {knots.dtype}, {w.dtype}"
        )
    # the kernels index in int32 (Triton's default): refuse what would overflow instead of reading wrong memory
    if max(x.numel(), w.numel(), x.shape[0] * w.shape[2]) >= 2**31:
        raise RuntimeError("fused B-spline (Triton): a tensor of 2^31 elements or more; split the batch or the layer")


def forward(
    x: torch.Tensor, knots: torch.Tensor, w: torch.Tensor, k: int, value_rows: torch.Tensor, slope_rows: torch.Tensor
) -> torch.Tensor:
    """(batch, out): the spline term, as ``extension().forward`` (x (batch, in), knots (in, n_knots)
    uniform per input, w (in, G + k, out))."""
    _check(x, knots, w, k)
    x, knots, w = x.contiguous(), knots.contiguous(), w.contiguous()
    batch, n_in = x.shape
    n_bases, n_out = w.shape[1], w.shape[2]
    out = torch.empty(batch, n_out, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if n_in == 0:
        return out.zero_()
    grid = (triton.cdiv(batch, BLOCK_ROWS), triton.cdiv(n_out, BLOCK_OUTPUTS))
    with _on_device(x):
        _forward_kernel[grid](
            x,
            knots,
            w,
            out,
            _device_rows(value_rows, x),
            batch,
            n_in,
            knots.shape[1],
            n_bases,
            n_out,
            K=k,
            BLOCK_B=BLOCK_ROWS,
            BLOCK_O=BLOCK_OUTPUTS,
        )
    return out


def backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    knots: torch.Tensor,
    w: torch.Tensor,
    k: int,
    value_rows: torch.Tensor,
    slope_rows: torch.Tensor,
    need_x: bool,
    need_w: bool,
) -> list[torch.Tensor | None]:
    """[grad_x (batch, in) or None, grad_w (in, G + k, out) or None], as ``extension().backward``
    (whose undefined tensors reach Python as None)."""
    _check(x, knots, w, k)
    grad, x, knots, w = grad.contiguous(), x.contiguous(), knots.contiguous(), w.contiguous()
    batch, n_in = x.shape
    n_bases, n_out = w.shape[1], w.shape[2]
    n_knots = knots.shape[1]
    grad_x = torch.zeros_like(x) if need_x else None
    grad_w = torch.zeros_like(w) if need_w else None  # zeros: the atomic adds accumulate into it
    with _on_device(x):
        if grad_w is not None and batch * n_in * n_out > 0:
            grid = (triton.cdiv(batch, BLOCK_ROWS), triton.cdiv(n_out, BLOCK_OUTPUTS))
            _grad_w_kernel[grid](
                grad,
                x,
                knots,
                grad_w,
                _device_rows(value_rows, x),
                batch,
                n_in,
                n_knots,
                n_bases,
                n_out,
                K=k,
                BLOCK_B=BLOCK_ROWS,
                BLOCK_O=BLOCK_OUTPUTS,
            )
        if grad_x is not None and batch * n_in * n_out > 0:
            _grad_x_kernel[(triton.cdiv(batch, BLOCK_ROWS), n_in)](
                grad,
                x,
                knots,
                w,
                grad_x,
                _device_rows(slope_rows, x),
                batch,
                n_in,
                n_knots,
                n_bases,
                n_out,
                K=k,
                BLOCK_B=BLOCK_ROWS,
                BLOCK_O=BLOCK_OUTPUTS,
            )
    return [grad_x, grad_w]


def spline_weight(coef: torch.Tensor, scale_spline: torch.Tensor) -> torch.Tensor:
    """(in, G + k, out): the spline weight coef * scale_spline laid out along out, as the kernels read it."""
    return (coef * scale_spline.unsqueeze(-1)).permute(1, 2, 0).contiguous()


def coefficient_grads(
    grad_w: torch.Tensor, coef: torch.Tensor, scale_spline: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d coef, d loss / d scale_spline) from grad_w (in, G + k, out), the gradient of w."""
    grad_w = grad_w.permute(2, 0, 1)  # (out, in, G + k)
    return (grad_w * scale_spline.unsqueeze(-1)).contiguous(), (grad_w * coef).sum(-1)
