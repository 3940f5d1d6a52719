"""The fused B-spline KAN layer (``model.impl: fused``): the k + 1 non-zero bases of every input
evaluated in registers and contracted at once with the coefficients they select, in one C++ op
with OpenMP (``csrc/``: the kernels, the bases, the weight's layout), so the (batch, in, G + k)
basis tensor is never formed and autograd saves nothing but the layer's inputs. On CUDA GPUs the
same op runs Triton kernels (``triton_kernels.py``, :func:`kernels` chooses by the tensors' device).

The C++ op is built ahead of time (``kanscale build-ops``, which ``make install`` runs; the
build, its folder and the check that it can be built here: ``build.py``) and loaded when a model
asks for it, never inside a training step.

The two ops are registered with ``torch.library`` as ``kanscale::bspline_spline`` and its
backward, so torch.compile and the backends see one opaque op with a shape function. Eager steps on
CPUs skip the registration's Python dispatch and run the whole layer, base path included, in one
C++ call each way (:func:`fused_layer`, ``csrc/function.cpp``)."""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

from kan_models.bspline_bases import basis_matrix
from kan_models.bspline_fast import FastBSplineKANLayer
from kan_models.fused.build import extension


def kernels(device: torch.device) -> ModuleType:
    """The op's kernels for a device, one interface (``forward``, ``backward``, and the weight's layout
    ``spline_weight`` and its gradients' ``coefficient_grads``): the C++ extension on
    CPUs, the Triton kernels on CUDA GPUs (triton_kernels.py, imported here only, so that a machine
    without triton still imports this package)."""
    if device.type == "cuda":
        from kan_models.fused import triton_kernels

        return triton_kernels
    return extension()


@functools.cache
def triton_installed() -> bool:
    """Looked up once a process: the layer asks on every forward on CUDA, and find_spec searches
    sys.path each time."""
    return importlib.util.find_spec("triton") is not None


def device_unavailable(device: torch.device) -> str | None:
    """Why the layer cannot run on a device, naming the fix (after "model.impl: fused "), or None."""
    if device.type == "cuda" and not triton_installed():
        return (
            "runs on CUDA GPUs as a Triton kernel, and triton is not installed: pip install triton, or set "
            "model.impl=fast"
        )
    if device.type not in ("cpu", "cuda"):
        return f"runs on CPUs (a C++ op) and CUDA GPUs (a Triton kernel), not on {device.type}: set model.impl=fast"
    return None


@functools.cache
def _rows(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    value, slope = basis_matrix(k)
    return torch.tensor(value, dtype=torch.float64), torch.tensor(slope, dtype=torch.float64)


# checked in Python: even a call of Tensor.to that changes nothing costs a dispatch
WIDE = (torch.float32, torch.float64)


def wide(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The operands in at least float32: bf16 and fp16 are stored narrow but computed (the
    weight's product, the op, the gradients' reductions) in float32 and rounded once at the end;
    rounded at every step, bf16's coefficient gradients drift from the float32 reference's by
    percents (docs/models.md)."""
    return [t if t.dtype in WIDE else t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype (the result of a widened computation rounded back once)."""
    return t if t.dtype == dtype else t.to(dtype)


def spline_forward(
    x: torch.Tensor, knots: torch.Tensor, coef: torch.Tensor, scale_spline: torch.Tensor, k: int
) -> torch.Tensor:
    """sum_i sum_j B_j(x_i) coef[o, i, j] scale_spline[o, i], (batch, out)."""
    xw, knots, coef, scale_spline = wide(x, knots, coef, scale_spline)
    ops = kernels(x.device)
    return cast(ops.forward(xw, knots, ops.spline_weight(coef, scale_spline), k, *_rows(k)), x.dtype)


def spline_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    knots: torch.Tensor,
    coef: torch.Tensor,
    scale_spline: torch.Tensor,
    k: int,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad coef, grad scale_spline); an empty tensor for each not asked for."""
    dtypes = x.dtype, coef.dtype, scale_spline.dtype
    grad, x, knots, coef, scale_spline = wide(grad, x, knots, coef, scale_spline)
    ops = kernels(x.device)
    gx, gw = ops.backward(grad, x, knots, ops.spline_weight(coef, scale_spline), k, *_rows(k), need_x, need_weight)
    gx = gx.to(dtypes[0]) if need_x else x.new_empty(0, dtype=dtypes[0])
    if not need_weight:
        return gx, coef.new_empty(0, dtype=dtypes[1]), coef.new_empty(0, dtype=dtypes[2])
    g_coef, g_scale = ops.coefficient_grads(gw, coef, scale_spline)
    return gx, g_coef.to(dtypes[1]), g_scale.to(dtypes[2])


# The same two functions as torch.library ops, which torch.compile and the backends see as one opaque
# op with a shape function (eager steps on CPUs take fused_layer instead).
spline_term = torch.library.custom_op("kanscale::bspline_spline", mutates_args=())(spline_forward)
spline_term_backward = torch.library.custom_op("kanscale::bspline_spline_backward", mutates_args=())(spline_backward)


@spline_term.register_fake
def _(x, knots, coef, scale_spline, k):
    return x.new_empty(x.shape[0], coef.shape[0])


@spline_term_backward.register_fake
def _(grad, x, knots, coef, scale_spline, k, need_x, need_weight):
    return (
        x.new_empty(x.shape if need_x else (0,)),
        coef.new_empty(coef.shape if need_weight else (0,)),
        scale_spline.new_empty(scale_spline.shape if need_weight else (0,)),
    )


def _setup(ctx, inputs, output) -> None:
    x, knots, coef, scale_spline, k = inputs
    ctx.save_for_backward(x, knots, coef, scale_spline)  # the inputs only: the bases are recomputed
    ctx.k = k


def _gradients(ctx, grad: torch.Tensor) -> tuple:
    x, knots, coef, scale_spline = ctx.saved_tensors
    need_x, _, need_coef, need_scale = ctx.needs_input_grad[:4]
    gx, g_coef, g_scale = spline_term_backward(
        grad.contiguous(), x, knots, coef, scale_spline, ctx.k, need_x, need_coef or need_scale
    )
    return (gx if need_x else None), None, (g_coef if need_coef else None), (g_scale if need_scale else None), None


spline_term.register_autograd(_gradients, setup_context=_setup)


def fused_layer(
    x: torch.Tensor,
    knots: torch.Tensor,
    coef: torch.Tensor,
    scale_spline: torch.Tensor,
    scale_base: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """The whole layer, its SiLU base path with the spline term, in one C++ call each way, for eager
    steps on CPUs: a C++ autograd function (csrc/function.cpp), whose backward the engine runs
    without Python. The registered op, with the base path around it in PyTorch, serves torch.compile
    (which cannot trace a call into C++ from here) and CUDA: in eager steps the op's Python
    dispatch and the base path's three autograd nodes cost more than the layer's arithmetic at
    the study's size (docs/models.md)."""
    return extension().layer(x, knots, coef, scale_spline, scale_base, k, *_rows(k))


class FusedBSplineKANLayer(FastBSplineKANLayer):
    """The fast layer's function (the same closed-form bases on its uniform grid, the same
    parameters, buffers, state dict and grid update) computed by the fused op, whose backward
    recomputes the bases from the inputs: in eager steps on CPUs with the SiLU base path in one
    C++ call (fused_layer); compiled, and on GPUs, the base path one GEMM beside the op.

    ``fused_on`` names the device types that take the op; on others the layer is the fast layer
    (``model.impl: auto`` fuses on CPUs only, where the op is measured faster). None, for
    ``model.impl: fused``: every device takes the op, and one it has no kernel for is refused."""

    def __init__(self, *args, fused_on: tuple[str, ...] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fused_on = fused_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if self.fused_on is not None and device not in self.fused_on:
            return super().forward(x)
        if device != "cpu" and (why := device_unavailable(x.device)):
            raise RuntimeError(f"model.impl: fused {why}")
        # one dtype for every operand, as the fast layer: autocast's where it is on, else the parameters'
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else self.coef.dtype
        eager_cpu = device == "cpu" and not torch.compiler.is_compiling()
        if not autocast:  # the common case: entering a context costs a share of a small layer's step
            return self._layer(x, dtype, eager_cpu)
        # autocast off inside: the op and the base path compute in dtype
        with torch.autocast(device, enabled=False):
            return self._layer(x, dtype, eager_cpu)

    def _layer(self, x: torch.Tensor, dtype: torch.dtype, eager_cpu: bool) -> torch.Tensor:
        x = cast(x, dtype).contiguous()
        # the knots as stored (float32 under every backend): rounded to bf16 they would no longer be uniform
        coef, scale_spline, scale_base = (
            cast(self.coef, dtype),
            cast(self.scale_spline, dtype),
            cast(self.scale_base, dtype),
        )
        if eager_cpu:
            return fused_layer(x, self.knots, coef, scale_spline, scale_base, self.k)
        return F.linear(F.silu(x), scale_base) + spline_term(x, self.knots, coef, scale_spline, self.k)
