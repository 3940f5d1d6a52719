"""Peak memory of one rank under each strategy: the model state it holds (exact, strategy_model's
``model_state``), what the backend gathers or keeps whole during a step beyond that share, and
what the step needs beside both (runtime, data, activations), measured on one process and scaled
by the micro-batch. Pure functions on numbers, as the rest of the projection.

Model state alone does not decide what fits: ZeRO-3 gathers every parameter before forward and
holds it through backward, FSDP one layer (and the next, prefetched), and ZeRO-1/2 reduce whole
gradients before keeping their shard, so a strategy's peak lies above its share by that much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.projection.inputs import ModelShape
from analysis.projection.strategy_model import StrategyModel, model_state


@dataclass(frozen=True)
class StepMemory:
    """What a rank holds beside the model state, from one measured process: ``fixed`` bytes
    whatever the batch (the runtime: interpreter, libraries, communication buffers; the task's
    data) and ``per_sample`` bytes for each sample of the micro-batch (the tensors autograd saves
    for backward and the step's temporaries)."""

    source: str
    fixed: float
    per_sample: float
    # optimizer state the per-parameter formula leaves out, measured on one rank: torch's Adam keeps
    # a 4-byte step counter per tensor it updates (DeepSpeed's one per flat partition); kept per rank
    counters: float = 0.0

    def at(self, micro_batch: float) -> float:
        return self.fixed + self.per_sample * micro_batch


@dataclass(frozen=True)
class PeakMemory:
    """A rank's predicted peak, by part (bytes)."""

    model_state: float
    gathered: float  # parameters and gradients held whole during a step beyond the rank's share
    beside: float  # runtime, data and the micro-batch's activations (StepMemory.at)
    host: float = 0.0  # of the model state, what offload keeps in host memory (off the device)

    @property
    def total(self) -> float:
        return self.model_state + self.gathered + self.beside


def gathered_bytes(m: StrategyModel, shape: ModelShape, ranks: int, ranks_per_node: int | None = None) -> float:
    """What the backend holds whole beyond the rank's share at its step's peak: ZeRO-3 every
    parameter (gathered before forward, kept through backward) and the whole gradient it
    reduce-scatters; FSDP two layers' parameters (the one computing and the next, prefetched) and
    one layer's whole gradient; ZeRO-1/2 the whole gradient they all-reduce before keeping their
    shard. One rank gathers nothing; hybrid sharding gathers from its shard group only. Bytes as
    the rank holds them (:meth:`StrategyModel.held_bytes`)."""
    b = m.held_bytes(shape)
    tp = m.tp_ranks(ranks)
    group = m.shard_ranks(ranks // tp, ranks_per_node)
    if group == 1:
        return 0.0
    missing = 1 - 1 / group  # of a whole tensor, what the other ranks of the group hold
    trainable = shape.trainable * b / tp
    if m.gather == "before_forward":
        return (shape.params * b / tp + trainable) * missing
    if m.gather == "per_unit":
        units = sorted((u * b / tp for u in shape.units), reverse=True)
        return (sum(units[:2]) + units[0]) * missing
    if m.sharded_state:
        return trainable * missing
    return 0.0


def peak_memory(
    m: StrategyModel,
    shape: ModelShape,
    ranks: int,
    micro_batch: float,
    beside: StepMemory,
    offload_on_device: bool,
    ranks_per_node: int | None = None,
) -> PeakMemory:
    """A rank's peak at ``ranks`` ranks (``ranks_per_node`` on a node) and ``micro_batch`` samples
    per step. ``offload_on_device``: whether offloaded state still counts (a CPU rank's host is its
    device)."""
    state = model_state(m, shape, ranks, ranks_per_node)
    host = state["optimizer"] + state["master_params"] if m.offload else 0.0
    held = sum(state.values()) + beside.counters - (0.0 if offload_on_device else host)
    return PeakMemory(
        model_state=held,
        gathered=gathered_bytes(m, shape, ranks, ranks_per_node),
        beside=beside.at(micro_batch),
        host=host,
    )


def largest_micro_batch(
    m: StrategyModel,
    shape: ModelShape,
    ranks: int,
    beside: StepMemory,
    capacity: float,
    offload_on_device: bool,
    ranks_per_node: int | None = None,
) -> int:
    """The most samples per step that fit in ``capacity`` bytes per rank (0: none fits)."""
    empty = peak_memory(m, shape, ranks, 0, beside, offload_on_device, ranks_per_node).total
    if empty > capacity:
        return 0
    if beside.per_sample <= 0:
        return 2**31 - 1
    return math.floor((capacity - empty) / beside.per_sample)
