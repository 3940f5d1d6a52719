"""The two ways a rank gets its micro-batches, behind one call: ``batches(step)``.

``memory`` (the default) indexes tensors every rank holds with the suite's own split
(strategies/runtime/batch_plan.py): no copies, no processes, the same samples for every strategy.

``dataloader`` is what most training scripts and the published study do: a
``torch.utils.data.DataLoader`` over the training set with a ``DistributedSampler`` (shuffled by
the seed and the epoch, each data-parallel rank a strided share) and ``training.loader_workers``
worker processes that collate batches while the model trains, pinned for the copy to a GPU.
The time a step waits for its batch (the workers, the collation, the copy to the device) is the
step's data time, reported apart from compute and communication.

Parity under the DataLoader: one DataLoader run at one rank and one at P ranks see the same
samples in each step (a step's global batch is the same P x micro_batch consecutive indices of
the epoch's permutation, split round-robin), so their losses match where the sampler does not pad.
It pads when the training set does not divide by the ranks: it repeats the first samples of the
epoch to even the ranks out, so those are seen twice. Its order is not the memory path's (another
permutation), so the two paths train differently from step 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from strategies.runtime.batch_plan import BatchPlan, rank_micro_batches
from strategies.sections import TrainingConfig
from strategies.step.engine import Batch


class MemoryBatches:
    """Micro-batches indexed from the training tensors (on the device) by the suite's split."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, plan: BatchPlan, training: TrainingConfig, dp_size: int, dp_rank: int
    ) -> None:
        self.x, self.y, self.plan = x, y, plan
        self.grad_accum, self.dp_size, self.dp_rank = training.grad_accum, dp_size, dp_rank

    def batches(self, step: int) -> tuple[list[Batch], int]:
        """This rank's micro-batches of ``step`` (0-based) and the samples in the step over all ranks."""
        indices = self.plan.global_indices(step)
        shards = rank_micro_batches(indices, self.grad_accum, self.dp_size, self.dp_rank)
        # index_select: Python's indexing parses its index on every call, index_select takes it as it is
        return [(self.x.index_select(0, i), self.y.index_select(0, i)) for i in shards], len(indices)

    def close(self) -> None:
        pass


class EpochBatchSampler:
    """The sampler's micro-batches of index lists, epoch after epoch, from a step on: what the
    DataLoader's workers fetch. Iterated once, in the main process, which sets each epoch."""

    def __init__(self, sampler: DistributedSampler, micro_batch: int, first_epoch: int, skip: int, epochs: int) -> None:
        self.sampler, self.micro_batch = sampler, micro_batch
        self.first_epoch, self.skip, self.epochs = first_epoch, skip, epochs

    def __iter__(self) -> Iterator[list[int]]:
        for epoch in range(self.first_epoch, self.first_epoch + self.epochs):
            self.sampler.set_epoch(epoch)
            order = list(self.sampler)
            batches = (order[i : i + self.micro_batch] for i in range(0, len(order), self.micro_batch))
            yield from itertools.islice(batches, self.skip if epoch == self.first_epoch else 0, None)


class LoaderBatches:
    """Micro-batches from a DataLoader with a DistributedSampler (see the module docstring)."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        plan: BatchPlan,
        training: TrainingConfig,
        micro_batch: int,
        dp_size: int,
        dp_rank: int,
        device: torch.device,
        start_step: int,
    ) -> None:
        dataset = TensorDataset(x.cpu(), y.cpu())
        self.sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=training.seed
        )
        self.grad_accum, self.dp_size, self.device = training.grad_accum, dp_size, device
        self.per_epoch = math.ceil(len(self.sampler) / micro_batch)  # micro-batches per rank per epoch
        self.steps_per_epoch = plan.steps_per_epoch
        first_epoch, offset = divmod(start_step, self.steps_per_epoch)
        epochs = math.ceil(plan.total_steps / self.steps_per_epoch) - first_epoch
        batch_sampler = EpochBatchSampler(self.sampler, micro_batch, first_epoch, offset * self.grad_accum, epochs)
        workers = training.loader_workers
        # One iterator over every epoch (the batch sampler spans them), so the workers live for the
        # run without persistent_workers, whose iterator the DataLoader would keep alive itself.
        loader = DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=2 if workers else None,
        )
        self.iterator: Iterator[list[torch.Tensor]] | None = iter(loader)

    def batches(self, step: int) -> tuple[list[Batch], int]:
        if self.iterator is None:
            raise RuntimeError("the data loader was closed: its workers are gone")
        # The epoch's last step takes what is left of its micro-batches, as the memory path's does.
        offset = step % self.steps_per_epoch
        count = min(self.grad_accum, self.per_epoch - offset * self.grad_accum)
        batches = [self._on_device(*next(self.iterator)) for _ in range(count)]
        # Every rank holds as many samples (the sampler pads), so the step's total is known here.
        return batches, self.dp_size * sum(len(x) for x, _ in batches)

    def _on_device(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the worker processes now, not at interpreter exit: forked from rank 0, they hold
        its descriptors, the run directory's lock among them (strategies/lifecycle/run_lock.py)."""
        self.iterator = None  # the last reference: the iterator's finaliser shuts the workers down


def batch_source(
    x: torch.Tensor,
    y: torch.Tensor,
    plan: BatchPlan,
    training: TrainingConfig,
    micro_batch: int,
    dp_size: int,
    dp_rank: int,
    device: torch.device,
    start_step: int,
) -> MemoryBatches | LoaderBatches:
    """The experiment's data path (``training.loader``) for this rank."""
    if training.loader == "dataloader":
        return LoaderBatches(x, y, plan, training, micro_batch, dp_size, dp_rank, device, start_step)
    return MemoryBatches(x, y, plan, training, dp_size, dp_rank)
