"""The answer ``kanscale recommend`` gives: every candidate strategy laid out on the target,
at the largest micro-batch that fits (gradient accumulation where the global batch does not fit in
one), its projected rate with an interval, its peak memory against the device's, and a ranking
with one line of why. Pure functions on numbers, as the rest of the projection."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from analysis.projection.collectives import Network
from analysis.projection.inputs import ComputeProfile, ModelShape
from analysis.projection.memory import PeakMemory, StepMemory, largest_micro_batch, peak_memory
from analysis.projection.step_model import Projection, Scenario, nodes_for, project_step
from analysis.projection.strategy_model import StrategyModel
from analysis.projection.uncertainty import ENDS

MAX_ACCUMULATION = 1024  # the most micro-batches per step tried before a strategy is called unfit


@dataclass(frozen=True)
class End:
    """The target at one end of the inputs' ranges: its links and its compute per the profile's."""

    network: Network
    compute_scale: float = 1.0
    contention: float = 1.0  # compute slowed by this when ranks share the machine (CPU cores)


@dataclass(frozen=True)
class Target:
    """Where the training would run: the layout, each rank's device memory, the links between the
    ranks, and how its compute relates to the measured profile; and the same with every input at
    its pessimistic (``slow``) and its optimistic (``fast``) end."""

    name: str
    nodes: int
    ranks_per_node: int
    memory_per_rank: float  # bytes
    network: Network
    compute_scale: float = 1.0  # the target's compute time per the profile's
    contention: float = 1.0  # compute slowed by this when ranks share the machine (CPU cores)
    offload_on_device: bool = True  # offloaded state counts against the memory (a CPU rank's host is its device)
    slow: End | None = None  # None: as stated
    fast: End | None = None
    # of the compute, the share each bound accounts for (device_time's bounds on a GPU target)
    compute_bounds: dict[str, float] = field(default_factory=lambda: {"compute": 1.0})
    interval: str = "interval: none (every input taken as exact)"  # where the interval comes from, in words
    notes: tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def at(self, end: str) -> End:
        chosen = {"slow": self.slow, "fast": self.fast}.get(end)
        return chosen or End(self.network, self.compute_scale, self.contention)


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
    samples_per_s_low: float = 0.0  # every input at its pessimistic end
    samples_per_s_high: float = 0.0  # every input at its optimistic end
    why: str = ""
    rank: int = 0
    replicas: int = 1  # data-parallel model replicas (ranks / TP degree)
    largest_widths: list[int] | None = None  # at fixed depth, the widest model that fits (estimated)
    widths_beyond: bool = False  # the widths search stopped at its cap: wider ones fit too
    micro_batch_beyond: bool = False  # nothing predicted grows with the micro-batch: no limit was found
    bound: str = ""  # what the predicted step spends most of its time on (BOUNDS)
    by_bound: dict[str, float] = field(default_factory=dict)  # the step's seconds per bound
    tied: bool = False  # shares its rank: the intervals overlap

    @property
    def samples_per_s(self) -> float:
        return self.projection.samples_per_s if self.projection else 0.0

    @property
    def headroom(self) -> float:
        """Of the device's memory, the share left at the predicted peak (negative: over)."""
        return 1 - self.peak.total / self.capacity

    @property
    def bound_words(self) -> str:
        """The step's bound and its share, e.g. ``launches/host (98% of 4.2 ms)``."""
        if not self.bound or self.projection is None:
            return "-"
        step = self.projection.step_s
        return f"{self.bound} ({self.by_bound[self.bound] / step:.0%} of {step * 1e3:.3g} ms)"


BOUNDS = ("launches/host", "compute", "memory bandwidth", "communication")


def measured_ends(profile: ComputeProfile, spread: float) -> dict[str, ComputeProfile]:
    """A profile measured here at every end: its times +-``spread`` (the probes' spread)."""

    def times(factor: float) -> ComputeProfile:
        p = profile
        return replace(
            p,
            compute_s=p.compute_s * factor,
            optimizer_s=p.optimizer_s * factor,
            data_s=p.data_s * factor,
            overhead_s=p.overhead_s * factor,
        )

    return {"value": profile, "slow": times(1 + spread), "fast": times(max(1 - spread, 0.0))}


def lay_out(
    m: StrategyModel,
    shape: ModelShape,
    compute: Mapping[str, ComputeProfile],
    beside: StepMemory,
    target: Target,
    global_batch: int,
) -> Candidate:
    """Strategy ``m`` on the target at ``global_batch`` samples per step: the fewest micro-batches
    per step (each of global_batch / (replicas x accumulation) samples) whose peak fits; its rate
    with every input at its stated value (``compute["value"]``, the target's network) and at each
    end (``compute["slow"]`` and ``["fast"]`` where given, the target's ``slow`` and ``fast``)."""
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
    projections = {
        end: project_step(
            m,
            shape,
            compute.get(end, compute["value"]),
            target.at(end).network,
            Scenario(
                P,
                nodes_for(P, target.ranks_per_node),
                micro * accum,
                target.at(end).compute_scale,
                target.at(end).contention,
            ),
        )
        for end in (ENDS if micro else ())
    }
    projection = projections.get("value")
    low = high = 0.0
    by_bound: dict[str, float] = {}
    if projection is not None:
        low, high = (replicas * projections[e].samples_per_rank / projections[e].step_s for e in ("slow", "fast"))
        by_bound = step_bounds(projection, compute["value"], target.compute_bounds)
    return Candidate(
        m.label,
        tp,
        micro,
        accum,
        fits,
        peak,
        target.memory_per_rank,
        largest,
        projection,
        low,
        high,
        replicas=replicas,
        micro_batch_beyond=largest > 0 and beside.per_sample <= 0,
        bound=max(by_bound, key=lambda b: by_bound[b]) if by_bound else "",
        by_bound=by_bound,
    )


def step_bounds(p: Projection, profile: ComputeProfile, compute_bounds: dict[str, float]) -> dict[str, float]:
    """The predicted step's seconds per bound: the compute by its bounds' shares, the host's work
    beside it (the data, a strategy's bookkeeping) as launches/host, the rest communication."""
    host = p.data_s + profile.overhead_s
    seconds = dict.fromkeys(BOUNDS, 0.0)
    for bound, share in compute_bounds.items():
        seconds[bound] += share * p.compute_s
    seconds["launches/host"] += host
    seconds["communication"] = max(0.0, p.step_s - p.compute_s - host)
    return seconds


def ranked(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Those that fit first, fastest predicted first; each with its place and one line of why.
    Those whose interval reaches into the interval of the fastest not yet placed share its place:
    equivalent within the stated uncertainty, not ranked against each other."""
    order = sorted(candidates, key=lambda c: (not c.fits, -c.samples_per_s))
    fitting = [c for c in order if c.fits]
    best = fitting[0] if fitting else None
    out: list[Candidate] = []
    while len(out) < len(fitting):
        head = fitting[len(out)]
        group = [c for c in fitting[len(out) :] if c is head or c.samples_per_s_high >= head.samples_per_s_low]
        place = len(out) + 1
        out += [replace(c, rank=place, tied=len(group) > 1, why=why(c, best, head, group)) for c in group]
    return out + [replace(c, rank=place, why=why(c, best)) for place, c in enumerate(order[len(out) :], len(out) + 1)]


def why(c: Candidate, best: Candidate | None, head: Candidate | None = None, group: Sequence[Candidate] = ()) -> str:
    """One line on why ``c`` ranks where it does."""
    from analysis.report.format import human_bytes

    if c.micro_batch == 0 and c.peak.total <= c.capacity:
        return f"the global batch does not split evenly over its {c.replicas} model replicas"
    p = c.projection
    if not c.fits or p is None:  # a candidate fits only with a micro-batch, and so with a projection
        at = f"at {c.micro_batch} samples" if c.micro_batch else "before any sample"
        return f"does not fit: {human_bytes(c.peak.total)} per rank {at}, of {human_bytes(c.capacity)}"
    cost = f"{p.collectives:g} collective(s) per step, {p.exposed_s * 1e3:.2f} ms exposed of {p.step_s * 1e3:.2f} ms"
    accum = f"; {c.grad_accum} micro-batches per step to fit" if c.grad_accum > 1 else ""
    others = [o.strategy for o in group if o is not c]
    lead = (
        "fastest predicted"
        if best is None or c is best
        else f"{1 - c.samples_per_s / best.samples_per_s:.0%} behind {best.strategy}"
    )
    if head is not None and c is not head:
        lead = f"= equivalent within the stated uncertainty to {head.strategy} ({lead}, inside the intervals)"
    elif others:
        lead += f"; = equivalent within the stated uncertainty: {', '.join(others)}"
    return f"{lead}: {cost}{accum}"


def one_device_verdict(best: Candidate | None, one: Candidate | None, ranks: int) -> str | None:
    """Where the model fits one device and more ranks gain nothing beyond the intervals (the best
    multi-rank rate's pessimistic end is not above one device's optimistic end), that, plainly."""
    if ranks <= 1 or best is None or one is None or not one.fits:
        return None
    if best.samples_per_s_low > one.samples_per_s_high:
        return None
    rate = "{:,.0f} samples/s [{:,.0f}-{:,.0f}]".format
    return (
        f"One device is the answer: {one.strategy} on 1 device is predicted at "
        f"{rate(one.samples_per_s, one.samples_per_s_low, one.samples_per_s_high)} ({one.micro_batch} x "
        f"{one.grad_accum} samples per step, {one.bound_words}), the best on {ranks} ranks, {best.strategy}, at "
        f"{rate(best.samples_per_s, best.samples_per_s_low, best.samples_per_s_high)}: within the stated "
        f"uncertainty {ranks} ranks gain nothing over one (predicted)"
    )


def assumption_lines(target: Target) -> list[str]:
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
        target.interval,
        "bound: of each predicted step, what takes most of it: the compute by "
        + (
            "the bound of each counted kernel (launches/host, compute, memory bandwidth)"
            if set(target.compute_bounds) != {"compute"}
            else "its measured time (compute)"
        )
        + "; the data time and measured bookkeeping as launches/host; the rest of the step as communication",
        *target.notes,
    ]
