"""The kernels a step launches, as one TorchDispatchMode sees them: every aten op that a GPU runs
as a kernel, with its FLOPs (torch's own FlopCounterMode formulas) and the bytes of its tensor
arguments and outputs, by phase of the step (forward, backward, optimizer).

One op is taken for one kernel. That misses: ops that launch several kernels (a matmul with a
split-K reduction, a foreach op over many tensors in chunks) or none beyond the host work
(scalar ops the GPU backend folds), and the fusion a compiled model would do. Ops that only
rewrite a tensor's metadata (views, ``detach``, ``empty``) launch nothing and are left out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from analysis.projection.device_time import Op

aten = torch.ops.aten
# Allocations and metadata changes beside the views (which ``OpOverload.is_view`` names): no kernel.
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
    aten._has_compatible_shallow_copy_type.default,
    torch.ops.prim.device.default,
}


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    return not (func.is_view or torch.Tag.inplace_view in func.tags or func in NO_KERNEL)


def nbytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class KernelRecorder(TorchDispatchMode):
    """Each kernel-launching aten op of the phase now running, as an Op: the ops autograd runs
    while a "forward" phase is set are taken as the backward's. Collectives are ops too (``c10d``
    ones launch a kernel on the device's stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = FlopCounterMode(display=False).flop_registry
        self.phase = "forward"
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and launches_kernel(func):
            formula: Callable[..., int] | None = self.flops.get(func._overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula else 0
            # what autograd's engine runs inside a forward phase is the backward (a backend's hooks too)
            phase = "backward" if self.phase == "forward" and torch._C._current_graph_task_id() != -1 else self.phase
            self.ops.append(Op(str(func.overloadpacket), phase, float(flops), float(nbytes((args, kwargs, out)))))
        return out

    @contextlib.contextmanager
    def phase_of_step(self, phase: str) -> Iterator[None]:
        """Record, while active, the ops of ``phase``."""
        self.phase = phase
        with self:
            yield
