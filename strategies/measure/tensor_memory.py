"""The tensors a step holds, by what they are: torch's MemTracker (a TorchDispatchMode with module
hooks) over one step, set up so that it runs under every backend. Used where a run counts its step
(strategies/measure/step_profile.py) and by the rehearsal (strategies/rehearsal/rehearse.py)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch

from analysis.records.schema_sections import TensorMemory


def _register_bare(package: str) -> None:
    """Put ``package`` in sys.modules without running its ``__init__``, so that its modules can be
    imported one by one. torch.distributed._tools's ``__init__`` imports every tool it holds, the
    runtime estimator among them and with it torch's compiler (torch._inductor): most of a second
    in every process that counts a step (docs/memory.md), for modules MemTracker never uses."""
    spec = importlib.util.find_spec(package)
    if package not in sys.modules and spec is not None:
        sys.modules[package] = importlib.util.module_from_spec(spec)


try:
    _register_bare("torch.distributed._tools")
    from torch.distributed._tools.mem_tracker import MemTracker
except ImportError:  # a torch whose tools need their package's __init__: run it after all
    for name in [m for m in sys.modules if m.startswith("torch.distributed._tools")]:
        del sys.modules[name]
    from torch.distributed._tools.mem_tracker import MemTracker

# MemTracker's categories (its keys are str enums), as the records name them
CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
    "Total": "peak",
}


class _NoHook:
    def remove(self) -> None:
        pass


class StepMemoryTracker(MemTracker):
    """torch's MemTracker, with two changes for a training step as backends run it.

    No gradient hook where autograd refuses one: on FSDP1's parameters, views of its flat
    parameters (whose gradients are the flat parameters', tracked), and on frozen parameters
    (pykan's masks and grids), which get no gradient. Such a parameter is marked as hooked already.

    A top-level module called again in forward is the step's next micro-batch (gradient
    accumulation), not a second iteration, which MemTracker refuses: its per-module statistics
    (which nothing here reads) start again, the tensors it tracks and its peak do not.
    (Private methods: tests/test_rehearsal.py and tests/test_step_profile.py run FSDP1, pykan and
    accumulation under it.)"""

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        for p in module.parameters():
            if not (p.is_leaf and p.requires_grad):
                self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


def held_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """A module holding ``model``'s leaf parameters and its buffers, for MemTracker: FSDP1 shows
    views of its flat parameters as the module's parameters, on which no gradient hook can be set."""
    holder = torch.nn.Module()
    holder.leaves = torch.nn.ParameterList([p for p in model.parameters() if p.is_leaf])
    for i, buffer in enumerate(model.buffers()):
        holder.register_buffer(f"buffer{i}", buffer)
    return holder


def by_category(snapshot: dict[Any, int]) -> dict[str, int]:
    """One device's snapshot as the records name its categories (absent ones 0)."""
    named = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    return {field: int(named.get(key, 0)) for key, field in CATEGORIES.items()}


def peak_memory(tracker: MemTracker, device: torch.device) -> TensorMemory:
    """The tracked step's peak on ``device``, by category."""
    return TensorMemory(**by_category(tracker.get_tracker_snapshot("peak").get(device, {})))
