"""The answer ``kanscale recommend`` gives: every candidate strategy laid out on the target,
at the largest micro-batch that fits (gradient accumulation where the global batch does not fit in
one), its projected rate with an interval, its peak memory against the device's, and a ranking
with one line of why. Pure functions on numbers, as the rest of the projection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from analysis.projection.collectives import Network
from analysis.projection.inputs import ComputeProfile, ModelShape
from analysis.projection.memory import PeakMemory, StepMemory, largest_micro_batch, peak_memory
from analysis.projection.step_model import Projection, Scenario, nodes_for, project_step
from analysis.projection.strategy_model import StrategyModel

MAX_ACCUMULATION = 1024  # the most micro-batches per step tried before a strategy is called unfit


@dataclass(frozen=True)
class Target:
    """Where the training would run: the layout, each rank's device memory, the links between the
    ranks, and how its compute relates to the measured profile."""

    name: str
    nodes: int
    ranks_per_node: int
    memory_per_rank: float  # bytes
    network: Network
    compute_scale: float = 1.0  # the target's compute time per the profile's
    contention: float = 1.0  # compute slowed by this when ranks share the machine (CPU cores)
    offload_on_device: bool = True  # offloaded state counts against the memory (a CPU rank's host is its device)
    comm_spread: float = 0.0  # relative uncertainty of the network's costs
    notes: tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Candidate:
    """One strategy laid out on the target."""

    strategy: str
    tp: int
    micro_batch: int
    grad_accum: int
    fits: bool
    peak: PeakMemory
    capacity: float
    largest_micro_batch: int
    projection: Projection | None  # None where nothing fits
    samples_per_s_low: float = 0.0
    samples_per_s_high: float = 0.0
    why: str = ""
    rank: int = 0
    replicas: int = 1  # data-parallel model replicas (ranks / TP degree)
    largest_widths: list[int] | None = None  # at fixed depth, the widest model that fits (estimated)

    @property
    def samples_per_s(self) -> float:
        return self.projection.samples_per_s if self.projection else 0.0

    @property
    def headroom(self) -> float:
        """Of the device's memory, the share left at the predicted peak (negative: over)."""
        return 1 - self.peak.total / self.capacity


def lay_out(
    m: StrategyModel,
    shape: ModelShape,
    compute: ComputeProfile,
    beside: StepMemory,
    target: Target,
    global_batch: int,
    compute_spread: float,
) -> Candidate:
    """Strategy ``m`` on the target at ``global_batch`` samples per step: the fewest micro-batches
    per step (each of global_batch / (replicas x accumulation) samples) whose peak fits."""
    P = target.ranks
    tp = m.tp_ranks(P)
    replicas = P // tp
    largest = largest_micro_batch(
        m, shape, P, beside, target.memory_per_rank, target.offload_on_device, target.ranks_per_node
    )
    per_replica = global_batch // replicas if global_batch % replicas == 0 else 0
    # the fewest micro-batches per step (a divisor of the replica's samples) that fit; else one sample each
    accum = next(
        (
            d
            for d in range(1, min(per_replica, MAX_ACCUMULATION) + 1)
            if per_replica % d == 0 and per_replica // d <= largest
        ),
        min(per_replica, MAX_ACCUMULATION) or 1,
    )
    micro = per_replica // accum if per_replica and per_replica % accum == 0 else 0
    fits = 0 < micro <= largest
    peak = peak_memory(m, shape, P, micro, beside, target.offload_on_device, target.ranks_per_node)
    projection = (
        project_step(
            m,
            shape,
            compute,
            target.network,
            Scenario(P, nodes_for(P, target.ranks_per_node), micro * accum, target.compute_scale, target.contention),
        )
        if micro
        else None
    )
    low = high = 0.0
    if projection is not None:
        doubt = compute_spread * projection.compute_s + target.comm_spread * projection.exposed_s
        samples = replicas * projection.samples_per_rank
        low, high = samples / (projection.step_s + doubt), samples / max(projection.step_s - doubt, 1e-12)
    return Candidate(
        m.label, tp, micro, accum, fits, peak, target.memory_per_rank, largest, projection, low, high, replicas=replicas
    )


def ranked(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Those that fit first, fastest predicted first; each with its place and one line of why."""
    order = sorted(candidates, key=lambda c: (not c.fits, -c.samples_per_s))
    best = next((c for c in order if c.fits), None)
    out = []
    for place, c in enumerate(order, 1):
        out.append(Candidate(**{**c.__dict__, "rank": place, "why": why(c, best)}))
    return out


def why(c: Candidate, best: Candidate | None) -> str:
    """One line on why ``c`` ranks where it does."""
    from analysis.format import human_bytes

    if c.micro_batch == 0 and c.peak.total <= c.capacity:
        return f"the global batch does not split evenly over its {c.replicas} model replicas"
    p = c.projection
    if not c.fits or p is None:  # a candidate fits only with a micro-batch, and so with a projection
        at = f"at {c.micro_batch} samples" if c.micro_batch else "before any sample"
        return f"does not fit: {human_bytes(c.peak.total)} per rank {at}, of {human_bytes(c.capacity)}"
    cost = f"{p.collectives:g} collective(s) per step, {p.exposed_s * 1e3:.2f} ms exposed of {p.step_s * 1e3:.2f} ms"
    accum = f"; {c.grad_accum} micro-batches per step to fit" if c.grad_accum > 1 else ""
    if c is best or best is None:
        return f"fastest predicted: {cost}{accum}"
    behind = 1 - c.samples_per_s / best.samples_per_s
    overlap = c.samples_per_s_high >= best.samples_per_s_low
    return (
        f"{behind:.0%} behind {best.strategy}"
        + (" (inside the intervals: a tie)" if overlap else "")
        + f": {cost}{accum}"
    )


def assumption_lines(target: Target, compute_spread: float) -> list[str]:
    """What the recommendation assumes beyond the projection's own assumptions."""
    return [
        f"target: {target.name}: {target.nodes} node(s) x {target.ranks_per_node} rank(s), "
        f"{target.memory_per_rank / 2**30:.2f} GiB per rank",
        "memory per rank: model state exact (as the records count it); plus what the backend holds whole during a "
        "step (ZeRO-3 every parameter and the whole gradient, FSDP two layers' parameters and one layer's "
        "gradient, ZeRO-1/2 the whole gradient; hybrid sharding from its shard group); plus "
        + (
            "the strategy's measured 1-rank peak less its model state, with saved-for-backward bytes per sample for "
            "other micro-batches"
            if target.offload_on_device
            else "the task's data and the saved-for-backward bytes per sample, counted here"
        ),
        f"interval: compute +-{compute_spread:.0%} (the 1-rank probes' spread between timing windows), "
        f"communication +-{target.comm_spread:.0%}",
        *target.notes,
    ]
