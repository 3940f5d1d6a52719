"""What ``kanscale bench`` can measure: its workloads (model sizes, batches, repeats) and the
implementations it compares, each a model config at a workload's size, optionally compiled. Free of
torch, so that ``kanscale bench --help`` lists them without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PYKAN_TOO_BIG = (
    "pykan keeps (batch, out, in) activations per layer (4 GiB each here) and its symbolic "
    "branch loops over every edge in Python: minutes per step"
)


@dataclass(frozen=True)
class Workload:
    widths: list[int]
    grid: int
    k: int
    batch: int
    warmup: int
    repeats: int
    about: str
    skip: dict[str, str] = field(default_factory=dict)  # implementation family -> why
    # untimed steps that open each implementation's round: a model whose working set fits in the caches is
    # otherwise timed cold (docs/performance.md)
    settle: int = 0


WORKLOADS: dict[str, Workload] = {
    "study": Workload(
        [2, 64, 1], 10, 3, 512, warmup=10, repeats=50, about="the published study's pykan model", settle=3
    ),
    "wide": Workload(
        [256, 1024, 1024, 1], 10, 3, 1024, warmup=1, repeats=5, about="a wide model", skip={"pykan": PYKAN_TOO_BIG}
    ),
    "fine": Workload(
        [256, 1024, 1],
        160,
        3,
        1024,
        warmup=1,
        repeats=3,
        about="a fine grid, as pykan's grid extension reaches (41 bases per non-zero one)",
        skip={"pykan": PYKAN_TOO_BIG},
    ),
    "tiny": Workload([2, 8, 1], 3, 3, 64, warmup=1, repeats=3, about="a smoke test", settle=1),
}

DEFAULT_WORKLOADS = ["study", "wide"]


def implementation_config(name: str, widths: list[int], grid: int, k: int) -> dict[str, Any]:
    """The model config of an implementation (without ``+compile``/``+step``) at a workload's size
    (``widths``, the B-spline's ``grid`` and order ``k``: a bench document records these three). rbf
    and chebyshev get as many basis functions per edge as the B-spline's G + k, the MLP as many
    trainable parameters as the B-spline KAN."""
    spline = {"grid": grid, "k": k}
    configs: dict[str, dict[str, Any]] = {
        "pykan": {"family": "pykan", **spline},
        "pykan-lean": {"family": "pykan", **spline, "symbolic_enabled": False, "save_act": False},
        "reference": {"family": "bspline", **spline, "impl": "reference"},
        "fast": {"family": "bspline", **spline, "impl": "fast"},
        "fast-dense": {"family": "bspline", **spline, "impl": "fast", "product": "dense"},
        "fast-sparse": {"family": "bspline", **spline, "impl": "fast", "product": "sparse"},
        "fused": {"family": "bspline", **spline, "impl": "fused"},
        "rbf": {"family": "rbf", "grid": grid + k},
        "chebyshev": {"family": "chebyshev", "degree": grid + k - 1},
        "mlp": {"family": "mlp", "match": {"family": "bspline", **spline}},
    }
    return {**configs[name], "widths": widths}


IMPLEMENTATIONS = [
    "pykan",
    "pykan-lean",
    "reference",
    "fast",
    "fast-dense",
    "fast-sparse",
    "fused",
    "rbf",
    "chebyshev",
    "mlp",
]
# +compile: torch.compile the model (training.compile: model); +step: compile the whole train
# step as training.compile: step does (strategies/step/compiled_step.py).
MODES = ("+compile", "+step")


def split_impl(impl: str) -> tuple[str, str]:
    """An implementation name as (model implementation, mode suffix or "")."""
    for mode in MODES:
        if impl.endswith(mode):
            return impl.removesuffix(mode), mode
    return impl, ""


DEFAULT_IMPLS = [
    "pykan",
    "pykan+compile",
    "reference",
    "reference+compile",
    "fast",
    "fast+compile",
    "fused",
    "rbf",
    "chebyshev",
    "mlp",
]
