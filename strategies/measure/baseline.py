"""The compute-only baseline exposed communication is measured against.

An unwrapped replica of the model, with the same optimizer doing the same arithmetic, runs this
rank's share of a step (forward and backward over the same micro-batches, then the optimizer
step) with no communication at all: a plain one-process :class:`Engine`, compiled as the
training's step is. It is sampled between timing windows, all ranks at once, so
it sees the machine as the training around it does: when the machine slows down halfway through
a run, the baseline slows down with it, and a difference of the two stays a difference of like
with like.

The replica holds its own parameters, gradients and optimizer state; their bytes, counted from
its tensors after its warm-up (``held_bytes``), are taken off the training's peaks, and the peaks
are read before each sample and reset after it, so the replica's own step never counts. Its
step's working memory is not taken off: on a CPU the allocator keeps what that step freed, and the
training's own step, which needs as much (the same model or the same share of it), reuses it. A
resident-memory difference across the warm-up would count that working memory as the replica's
and understate the training's peak (docs/metrics.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from strategies.sections import TrainingConfig
from strategies.step.engine import Batch, Engine, LossFn
from strategies.step.optim import build_optimizer
from strategies.step.precision import Amp, low_dtype


class ComputeBaseline:
    """The replica ``build_replica`` makes (on ``device``, with the training model's weights)
    and its optimizer."""

    def __init__(
        self, build_replica: Callable[[], nn.Module], device: torch.device, training: TrainingConfig, steps: int
    ) -> None:
        self.device = device
        replica = build_replica()
        # A learning rate of 0: the weights stay put, so the timing cannot be spoilt by a
        # learning rate that diverges, and every sample does the same arithmetic.
        still = training.model_copy(update={"lr": 0.0})
        # Under mixed precision the replica computes in the same low dtype, by autocast whatever
        # the backend's own mechanism (docs/precision.md says what that leaves out).
        self.engine = Engine(
            replica, build_optimizer(replica.parameters(), still), still, Amp(device.type, low_dtype(training))
        )
        self.steps = steps
        self.samples: list[float] = []

    def _step(self, batches: Sequence[Batch], n_global: int, loss_sum: LossFn) -> None:
        self.engine.forward_backward(batches, loss_sum, n_global)
        self.engine.step()

    def warm_up(self, batches: Sequence[Batch], n_global: int, loss_sum: LossFn, steps: int) -> None:
        """Untimed steps (the optimizer's state comes to exist), then what the replica holds."""
        for _ in range(max(1, steps)):
            self._step(batches, n_global, loss_sum)
        self._sync()
        self.held_bytes = sum(self.engine.model_state_bytes().model_dump().values())

    def sample(self, batches: Sequence[Batch], n_global: int, loss_sum: LossFn) -> float:
        """The median time of ``steps`` replica steps over ``batches`` (``n_global`` samples in
        the step over all ranks)."""
        times = []
        for _ in range(self.steps):
            start = time.perf_counter()
            self._step(batches, n_global, loss_sum)
            self._sync()
            times.append(time.perf_counter() - start)
        self.samples.append(statistics.median(times))
        return self.samples[-1]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
