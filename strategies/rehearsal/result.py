"""What a rehearsal reports for the rank it ran as (the record ``kanscale rehearse --json`` writes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pydantic import Field

from analysis.projection.device_time import Op, StepOps
from analysis.records.schema_sections import CommBytes, ModelStateBytes, Record, TensorMemory


class CollectiveCalls(Record):
    """One kind of collective the counted step issued, and how often."""

    kind: str = Field(description="all_reduce, all_gather, reduce_scatter, broadcast, ...")
    group_ranks: int = Field(ge=1, description="ranks in the group it ran in")
    link: str = Field(description="intra: the group lies inside one node; inter: it spans nodes")
    elements: int = Field(ge=0, description="the whole buffer, in elements (an all-gather's output)")
    dtype: str
    calls: int = Field(ge=1, description="calls of this kind in the step")
    sent_bytes: float = Field(ge=0.0, description="what this rank sends over all the calls (ring count)")


class Kernels(Record):
    """Kernels of the counted step alike in op, phase, FLOPs and bytes, and how many there were."""

    op: str = Field(description="the aten op, e.g. aten.mm")
    phase: str = Field(description="forward, backward or optimizer")
    flops: float = Field(ge=0.0, description="of one of them")
    bytes: float = Field(ge=0.0, description="read and written by one of them")
    count: int = Field(ge=1)

    @staticmethod
    def grouped(ops: Iterable[Op]) -> list[Kernels]:
        counts = Counter((o.name, o.phase, o.flops, o.bytes) for o in ops)
        return [Kernels(op=k[0], phase=k[1], flops=k[2], bytes=k[3], count=n) for k, n in counts.items()]


class Rehearsal(Record):
    """One strategy rehearsed at one world size, as one of its ranks."""

    strategy: str = Field(description="the strategy's label")
    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    rank: int = Field(ge=0, description="the rank this process ran as")
    mesh: dict[str, int] = Field(description="the run's device mesh, dimension by size")
    micro_batch: int = Field(ge=1, description="samples per micro-batch on this rank")
    parameters: int = Field(ge=0, description="the model's parameters, all ranks together")
    step: int = Field(ge=2, description="the step whose state, memory, FLOPs and kernels are given (1-based)")
    model_state: ModelStateBytes
    memory: TensorMemory
    comm: CommBytes | None = Field(description="the counted step's bytes by link, as a run records them")
    collectives: list[CollectiveCalls]
    flops: float = Field(ge=0.0, description="FLOPs of the counted step on this rank (FlopCounterMode)")
    kernels: int = Field(ge=0, description="kernel-launching ops of the counted step on this rank")
    ops: list[Kernels] = Field(
        default_factory=list, description="those kernels, grouped, for a device's time per op (docs/recommend.md)"
    )
    seconds: float = Field(ge=0.0, description="what the rehearsal took here")

    def step_ops(self) -> StepOps:
        """The counted step's kernels, one Op each, as the device-time model costs them."""
        ops = tuple(Op(k.op, k.phase, k.flops, k.bytes) for k in self.ops for _ in range(k.count))
        return StepOps(self.strategy, self.micro_batch, ops)

    def gathered_per_parameter(self) -> float | None:
        """All-gathered elements per model parameter: 1 where a backend gathers each parameter
        once, more where it pads its shards (FSDP2 pads dim 0 to a multiple of the ranks)."""
        gathered = sum(c.elements * c.calls for c in self.collectives if c.kind == "all_gather")
        return gathered / self.parameters if gathered and self.parameters else None


class Refusal(Record):
    """A strategy that could not be rehearsed at this layout, and why (what a launch would meet)."""

    strategy: str
    world_size: int
    reason: str
