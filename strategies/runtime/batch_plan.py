"""Which samples each rank trains on at each step.

A global batch (micro_batch x grad_accum x world_size samples) is cut first into grad_accum
micro-steps, then each micro-step into world_size rank shards. The cut depends only on the
seed, the step and those three sizes, never on the strategy, so every backend sees the same
data. An epoch's last global batch may be short: it is cut the same way, as evenly as possible,
and the loss is normalised by the samples actually in the step, so no sample is dropped or
repeated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BatchPlan:
    n_samples: int
    global_batch: int
    seed: int
    epochs: float | None = None
    steps: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_samples / self.global_batch)

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None, "a plan runs for a number of steps or of epochs"
        return max(1, math.ceil(self.epochs * self.steps_per_epoch))

    def epochs_done(self, steps: int) -> float:
        """Passes over the data after ``steps`` optimizer steps (fractional within an epoch)."""
        full, partial = divmod(steps, self.steps_per_epoch)
        seen = min(partial * self.global_batch, self.n_samples)
        return full + seen / self.n_samples

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return epoch_permutation(self.seed, epoch, self.n_samples)

    def global_indices(self, step: int) -> torch.Tensor:
        """Sample indices of the global batch of ``step`` (0-based)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        start = offset * self.global_batch
        return self.epoch_order(epoch)[start : start + self.global_batch]


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, n_samples: int) -> torch.Tensor:
    """An epoch's sample order, drawn once: every step of the epoch slices it (a permutation of a
    large data set drawn per step would cost more than a small model's step). Read only."""
    return torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n_samples))


def part_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of part ``index`` of ``length`` items cut into ``parts`` as evenly as possible,
    the longer parts first (as ``Tensor.tensor_split`` cuts)."""
    size, longer = divmod(length, parts)
    begin = index * size + min(index, longer)
    return begin, begin + size + (index < longer)


def rank_micro_batches(indices: torch.Tensor, grad_accum: int, world_size: int, rank: int) -> list[torch.Tensor]:
    """This rank's share of each micro-step of one global batch: one slice each, its bounds found
    by arithmetic rather than by tensor_split, whose views are a visible part of a small model's step."""
    shards = []
    for micro in range(grad_accum):
        first, end = part_bounds(len(indices), grad_accum, micro)
        begin, stop = part_bounds(end - first, world_size, rank)
        shards.append(indices[first + begin : first + stop])
    return shards
