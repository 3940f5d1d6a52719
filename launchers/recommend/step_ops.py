"""The operations of one training step of an experiment's model, counted here in one process for
the device-time model (analysis/projection/device_time.py): every aten op that a GPU runs as a
kernel, with its FLOPs (torch's own FlopCounterMode formulas) and the bytes of its tensor
arguments and outputs, for the forward, the backward and the optimizer step.

One op is taken for one kernel. That misses: ops that launch several kernels (a matmul with a
split-K reduction, a foreach op over many tensors in chunks) or none beyond the host work
(scalar ops the GPU backend folds), and the fusion a compiled model would do. Ops that only
rewrite a tensor's metadata (views, ``detach``, ``empty``) launch nothing and are left out."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from analysis.projection.device_time import Op, StepOps
from kan_models import build_model
from kan_models.base import ModelConfig
from strategies.sections import TrainingConfig

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


class _Recorder(TorchDispatchMode):
    """Each kernel-launching aten op of the phase now running, as an Op."""

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
            self.ops.append(Op(str(func.overloadpacket), self.phase, float(flops), float(nbytes((args, kwargs, out)))))
        return out


def count_step_ops(model: ModelConfig, training: TrainingConfig, micro_batch: int, seed: int = 0) -> StepOps:
    """The ops of one training step (forward, MSE loss, backward, the experiment's optimizer as a
    GPU runs it: ``foreach``) at ``micro_batch`` samples: on fake tensors (shapes, no storage: a
    model of any size in seconds) where the family can be built without computing, else on real
    ones (pykan fits its splines while it builds), and on real ones where a step reads a tensor's
    values (a data-dependent op, which fake tensors cannot run)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from launchers.zoo import meta_sketch

    if meta_sketch(model) is not None:
        try:
            with FakeTensorMode():
                return _count(model, training, micro_batch, seed)
        except DataDependentOutputException:
            pass
    return _count(model, training, micro_batch, seed)


def _count(model: ModelConfig, training: TrainingConfig, micro_batch: int, seed: int) -> StepOps:
    from strategies.optim import build_optimizer

    with contextlib.redirect_stdout(io.StringIO()):  # pykan prints its checkpoints
        net = build_model(model, seed)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, training)
    for group in optimizer.param_groups:
        if "foreach" in group:  # what torch picks on CUDA; on this CPU it would loop over the tensors
            group["foreach"] = True
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(micro_batch, model.widths[0], generator=generator)
    y = torch.rand(micro_batch, model.widths[-1], generator=generator)
    recorder = _Recorder()
    with _phase(recorder, "forward"):
        loss = torch.nn.functional.mse_loss(net(x), y)
    with _phase(recorder, "backward"):
        loss.backward()
    with _phase(recorder, "optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepOps(model.describe(), micro_batch, tuple(recorder.ops))


@contextlib.contextmanager
def _phase(recorder: _Recorder, phase: str) -> Iterator[None]:
    recorder.phase = phase
    with recorder:
        yield
