"""What one training step holds and computes on each rank, counted on the step a run counts its
bytes on (the last warm-up step, eager only: strategies/measure/comm_bytes.py says why):

- its tensors at the step's peak by category, and the activations each forward pass leaves for
  its backward (torch's MemTracker, strategies/measure/tensor_memory.py);
- its FLOPs by torch's FlopCounterMode formulas, with the forwards that activation checkpointing
  runs again in the backward apart: model FLOPs exclude them, hardware FLOPs include them.

Both are dispatch modes, so one step runs every op through Python; its time is in no window.
MemTracker is imported when the step comes: it brings in torch's compiler (a second of every
rank's start otherwise)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.records.schema import Flops, TensorMemory
from strategies.runtime.distributed import DistEnv
from strategies.step.engine import Engine
from strategies.step.schedule import innermost


def recomputing() -> bool:
    """Whether activation checkpointing is running a forward again, in the backward: torch's
    checkpoint sets its recomputation's saved-tensor hooks around it (torch/utils/checkpoint.py)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", "")


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops run while active, by FlopCounterMode's formulas; ``recomputed``: those run
    again by activation checkpointing (only as far as its backward needs: torch stops a
    recomputation early). A DTensor's op is counted as the local ops it runs (a tensor-parallel
    rank's share)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        super().__init__()
        self.formulas = FlopCounterMode(display=False).flop_registry
        self.total = self.recomputed = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs it as local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
            self.total += flops
            if recomputing():
                self.recomputed += flops
        return out


class StepProfile:
    """Counts one chosen step (0-based ``step``; None: none) on every rank: :meth:`around` wraps
    it, :meth:`memory` and :meth:`flops` combine the ranks' counts (collectives: every rank calls
    them). ``model`` is the unwrapped model, whose forward's end is where activations are read."""

    def __init__(self, env: DistEnv, step: int | None, model: nn.Module) -> None:
        self.env, self.step, self.model = env, step, model
        self.peak: TensorMemory | None = None
        self.after_forward = 0
        self.flop_count: FlopCount | None = None
        self.samples = 0

    @contextmanager
    def around(self, step: int, engine: Engine, samples: int) -> Iterator[None]:
        """Count ``step`` if it is the chosen one; ``samples``: the step's global samples."""
        if step != self.step:
            yield
            return
        from strategies.measure.tensor_memory import StepMemoryTracker, by_category, held_tensors, peak_memory

        tracker = StepMemoryTracker()
        tracker.track_external(held_tensors(engine.model), innermost(engine.optimizer))
        device = self.env.device

        def read_activations(*_: Any) -> None:
            if not recomputing():  # a recomputation's forward is not one a backward waits on
                current = by_category(tracker.get_tracker_snapshot("current").get(device, {}))
                self.after_forward = max(self.after_forward, current["activations"])

        self.flop_count, self.samples = FlopCount(), samples
        handle = self.model.register_forward_hook(read_activations)
        try:
            with ExitStack() as stack:
                stack.enter_context(tracker)
                stack.enter_context(self.flop_count)
                stack.enter_context(warnings.catch_warnings())
                # MemTracker reads .grad of FSDP1's parameter views, which autograd warns is never set
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                yield
        finally:
            handle.remove()
        self.peak = peak_memory(tracker, device)

    def memory(self) -> tuple[int, TensorMemory] | None:
        """The activations after forward and the step's peak by category, each the max over
        ranks; None where no step was counted."""
        peak = self.peak or TensorMemory(**dict.fromkeys(TensorMemory.model_fields, 0))
        local = torch.tensor(
            [self.peak is not None, self.after_forward, *peak.model_dump().values()], dtype=torch.float64
        )
        counted, after_forward, *categories = self.env.all_reduce(local.to(self.env.device), "max").cpu().tolist()
        if not counted:
            return None
        return int(after_forward), TensorMemory(
            **{k: int(v) for k, v in zip(peak.model_dump(), categories, strict=True)}
        )

    def flops(self) -> Flops | None:
        """Model and hardware FLOPs per sample of the counted step, all ranks' together; None where
        no step was counted."""
        c = self.flop_count
        local = torch.tensor(
            [c is not None, c.total if c else 0.0, c.recomputed if c else 0.0, self.samples], dtype=torch.float64
        )
        counted, total, recomputed, _ = self.env.all_reduce(local.to(self.env.device), "sum").cpu().tolist()
        if not counted or not self.samples or self.step is None:
            return None
        return Flops(
            step=self.step + 1,
            model_per_sample=(total - recomputed) / self.samples,
            hardware_per_sample=total / self.samples,
        )
