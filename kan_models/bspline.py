"""The B-spline KAN family (Liu et al. 2024): its config, and which of the three layers that compute
it a config builds: ``reference`` (the Cox-de Boor recursion, ``bspline_reference.py``), ``fast``
(closed-form bases on the uniform grid, ``bspline_fast.py``) and ``fused`` (the same in one op,
``fused/``). This module sits above the three; the registry imports it.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kan_models.base import Interval, LayerStack, ModelConfig
from kan_models.bspline_fast import FastBSplineKANLayer, use_sparse
from kan_models.bspline_reference import BSplineKANLayer
from kan_models.fused import FusedBSplineKANLayer
from kan_models.fused.build import extension, fused_unavailable
from kan_models.sparse_crossover import cpu_crossover
from kanscale import log

_log = log.get(__name__)

# Where impl: auto runs the fused op: on CPUs it beat the fast layer at every size measured
# (docs/performance.md, "The fused layer"); its Triton kernel is not measured on a GPU yet.
AUTO_FUSED_ON = ("cpu",)


def fused_ready() -> str | None:
    """Load the fused op, building it first where it is not built (before any step: the model's
    construction asks); why it cannot run here, or None."""
    return fused_unavailable() or _build_failure()


@functools.cache
def _build_failure() -> str | None:
    """Why the op failed to build although the probe built, once a process: a failed build is
    not tried again at every model this process builds."""
    try:
        extension()
    except RuntimeError as err:
        lines = str(err).strip().splitlines() or ["no message"]
        return f"the fused B-spline op failed to build: {lines[0]}"
    return None


@functools.cache
def _say_auto_runs_fast(reason: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # what every launcher sets: one line a run, not one a rank
        _log.warning(f"model.impl auto runs the fast layer here: {reason}")


def auto_impl(device_type: str) -> str:
    """What impl: auto runs on a device type, and why (the record's model.machine_choices)."""
    if device_type not in AUTO_FUSED_ON:
        return f"fast: the fused op is measured faster on {', '.join(AUTO_FUSED_ON)} only, not on {device_type}"
    if reason := fused_ready():
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
        "layer's function in one op that never forms the basis tensor (CPUs: C++ with OpenMP, built ahead by make "
        "install or kanscale build-ops; CUDA GPUs: Triton kernels, need triton); auto: fused on CPUs where the op "
        "is built or builds (measured faster there), fast elsewhere",
    )
    product: Literal["auto", "dense", "sparse"] = Field(
        "auto",
        description="how the fast layer multiplies its bases with the coefficients: dense (one GEMM over all "
        "G + k bases), sparse (CSR over the k + 1 non-zero ones), auto: sparse on CPUs from this CPU's measured "
        "crossover in bases per non-zero one (scripts/bench_sparse_crossover.py --save; 20 where none is measured)",
    )

    @model_validator(mode="after")
    def _product_needs_fast(self) -> BSplineConfig:
        if self.product != "auto" and self.impl not in ("fast", "auto"):
            raise ValueError(f"product {self.product} is a choice of the fast layer; set impl=fast or product=auto")
        if self.impl == "fused" and (reason := fused_unavailable()):
            raise ValueError(f"impl fused cannot be built here: {reason}; set impl=fast")
        return self

    def machine_choices(self, device_type: str) -> dict[str, str]:
        if self.impl == "auto":
            return {"impl": auto_impl(device_type)}
        if self.impl != "fast" or self.product != "auto":
            return {}
        bases = (self.grid + self.k) / (self.k + 1)
        chosen = "sparse" if use_sparse("auto", self.grid + self.k, self.k, torch.device(device_type)) else "dense"
        why = (
            f"{bases:.1f} bases per non-zero against a crossover of {cpu_crossover().describe()}"
            if device_type == "cpu"
            else f"no crossover is measured on {device_type}"
        )
        return {"product": f"{chosen}: {why}"}

    def build(self) -> LayerStack:
        auto_fast = self.impl == "auto" and (reason := fused_ready())
        if auto_fast:
            _say_auto_runs_fast(reason)
        layer: Callable[..., nn.Module]
        if self.impl == "fast" or auto_fast:
            layer = functools.partial(FastBSplineKANLayer, product=self.product)
        elif self.impl in ("fused", "auto"):
            extension()  # built (or loaded) now, before any step
            fused_on = None if self.impl == "fused" else AUTO_FUSED_ON
            layer = functools.partial(FusedBSplineKANLayer, product=self.product, fused_on=fused_on)
        else:
            layer = BSplineKANLayer
        return LayerStack(
            [
                layer(i, o, self.grid, self.k, self.grid_range, self.grid_eps, self.noise_scale)
                for i, o in itertools.pairwise(self.widths)
            ]
        )
