"""``measurement.comm_probe: paper``: the published study's communication measurement,
reproduced for comparison only. It changes the training; the default measurement does not.

What the study did, every second batch and only when the world size is above 1, after the
backward pass and before the optimizer step: time a no-grad forward (t1); time a forward plus an
explicit all-reduce of every gradient (t2); count (t2 - t1) / t2 as the batch's communication
overhead. The all-reduce sums the gradients DDP has already averaged, in place, so the optimizer
then steps with P times the gradient, and the probe's two forwards and all-reduce are paid inside
the training step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from strategies.measure.probes.probe import StepProbe
from strategies.runtime.distributed import DistEnv
from strategies.step.engine import Batch, Engine


class PaperProbe(StepProbe):
    """Declared by the strategies that support it (``probes`` on their config class): DDP."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.fractions: list[float] = []

    def after_backward(self, engine: Engine, batches: list[Batch], step: int) -> None:
        """Every second batch (the 2nd, 4th, ...), with more than one rank: the study's
        instrumentation on the DDP-wrapped model with this rank's first micro-batch."""
        if self.env.world_size > 1 and step % 2 == 1:
            self.probe(engine.model.module, batches[0][0])  # type: ignore[arg-type]  # nn.Module.__getattr__ is typed Tensor | Module

    def probe(self, module: nn.Module, x: torch.Tensor) -> None:
        """Run the study's instrumentation on the unwrapped ``module``: its forwards run outside DDP's hooks."""
        start = time.perf_counter()
        with torch.no_grad():
            module(x)
        self._sync()
        t1 = time.perf_counter() - start
        start = time.perf_counter()
        module(x)
        for param in module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)  # SUM of the already-averaged gradients, in place
        self._sync()
        t2 = time.perf_counter() - start
        self.fractions.append((t2 - t1) / t2)

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def results(self) -> dict[str, float | None]:
        """The study's number: the mean of (t2 - t1) / t2 over the probed batches, over ranks."""
        if not self.fractions:
            return {"paper_probe_overhead": None}
        local = torch.tensor([sum(self.fractions) / len(self.fractions)], dtype=torch.float64, device=self.env.device)
        return {"paper_probe_overhead": float(self.env.all_reduce(local, "sum")) / self.env.world_size}
