"""One optimizer step of each strategy at P ranks over N nodes: the collectives it issues and the
model state each rank holds (as its strategy class describes them: a :class:`StrategyModel`,
strategy_model.py), on a two-lane schedule (compute, communication) that overlaps them where the
strategy and the device allow; and every strategy projected over rank counts from that step. Pure
functions on numbers: nothing here starts a process group. docs/projection.md states the model,
its assumptions and how far it lands from measured runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from analysis.projection.collectives import Network
from analysis.projection.inputs import ComputeProfile, ModelShape
from analysis.projection.strategy_model import Exchange, StrategyModel, ddp_buckets, model_state, tp_exchanges

TAKEOVER_SEARCH = 4096  # largest rank count the takeover search tries


class _Schedule:
    """Tasks on two lanes, compute and communication, each serial, with dependencies. Without
    overlap both share one lane, so everything adds up."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.done: list[float] = []  # each task's finish time, by task index
        self.free = {False: 0.0, True: 0.0}  # when each lane (comm or not) is next free
        self.compute_s = self.comm_s = 0.0
        self.collectives = 0.0

    def add(self, seconds: float, comm: bool = False, after: Sequence[int] = ()) -> int:
        lane = comm and self.overlap
        start = max([self.free[lane], *(self.done[i] for i in after)])
        self.done.append(start + seconds)
        self.free[lane] = self.done[-1]
        if comm:
            self.comm_s += seconds
        return len(self.done) - 1

    def compute(self, seconds: float, after: Sequence[int] = ()) -> int:
        self.compute_s += seconds
        return self.add(seconds, after=after)

    def collective(self, seconds: float, after: Sequence[int] = ()) -> int:
        self.collectives += 1
        return self.add(seconds, comm=True, after=after)

    def everything(self) -> range:
        return range(len(self.done))

    @property
    def makespan(self) -> float:
        return max(self.done, default=0.0)


@dataclass(frozen=True)
class Scenario:
    ranks: int
    nodes: int
    samples_per_rank: float
    compute_scale: float = 1.0  # multiplies every compute time (another device)
    contention: float = 1.0  # multiplies compute when P > 1: ranks slowing each other down (CPU ranks sharing cores)
    probe: bool = False  # the published study's communication probe (see project_step)


@dataclass(frozen=True)
class Projection:
    strategy: str
    ranks: int
    nodes: int
    samples_per_rank: float
    step_s: float
    compute_s: float
    data_s: float
    comm_s: float  # collectives and host copies, summed, overlapped or not
    exposed_s: float  # step - data - compute, as the suite measures it
    collectives: float  # per step (the probe's come every second step)
    state: dict[str, float]
    host_bytes: float  # of the model state, what offload keeps on the host
    profile: str
    probe_overhead: float | None = None  # the published metric (t2 - t1) / t2 (project_step)
    tp: int = 1  # ranks per model replica (tensor parallelism): they train on the same samples
    speedup: float = math.nan
    efficiency: float = math.nan

    @property
    def comm_fraction(self) -> float:
        return self.exposed_s / self.step_s if self.step_s else 0.0

    @property
    def state_bytes(self) -> float:
        return sum(self.state.values())

    @property
    def samples_per_s(self) -> float:
        return self.ranks // self.tp * self.samples_per_rank / self.step_s


def project_step(
    m: StrategyModel, shape: ModelShape, profile: ComputeProfile, net: Network, sc: Scenario
) -> Projection:
    """One optimizer step of strategy ``m`` on one rank, the collectives as it describes them.

    Compute scales linearly with the rank's samples; backward time is spread over parameters in
    proportion to their bytes (a DDP bucket or an FSDP layer is ready once its share is done).
    With overlap (GPUs) DDP's buckets and FSDP's reduce-scatters run beside the rest of backward
    and FSDP's gathers beside the previous layer's compute (the next one prefetched); DeepSpeed's
    collectives block (overlap_comm off), as does everything without overlap (CPUs). Offload
    copies the gradient shard to the host and the updated parameter shard back, and runs the
    optimizer there. The probe adds, per step on average, one forward (two every second step)
    and half an all-reduce of every gradient tensor, one collective each, when P > 1; its own
    metric, (t2 - t1) / t2 with t1 a forward and t2 a forward plus those all-reduces, is returned
    as probe_overhead."""
    P, b = sc.ranks, shape.dtype_bytes
    tp = m.tp_ranks(P)
    dp = P // tp  # the data-parallel ranks the gradient and parameter collectives run over
    per_node = P // sc.nodes
    # Hybrid sharding: the collectives over a shard group on the links its ranks span, then the
    # replicas' all-reduce of each gradient shard across the groups (row-major: on other nodes).
    group = m.shard_ranks(dp, per_node)
    replicas = dp // group
    group_nodes = min(sc.nodes, dp) if replicas == 1 else nodes_for(group, per_node)
    speed = sc.compute_scale * (sc.contention if P > 1 else 1.0)
    # a whole model's step is shared out among the ranks that cut (TP) or shard (the optimizer's) it;
    # a rank's own step, rehearsed at the layout, is that share already
    cut, sharded = (1, 1) if profile.per_rank else (tp, group if m.sharded_state else 1)
    work = profile.compute_s * sc.samples_per_rank / profile.samples * speed / cut
    forward, backward = profile.forward_fraction * work, (1 - profile.forward_fraction) * work
    optimizer = profile.optimizer_s * speed / cut / sharded
    if m.offload:
        optimizer *= net.host_optimizer_slowdown

    def coll(op: str, nbytes: float) -> float:
        return net.collective_s(op, nbytes, group, group_nodes)

    def reduce_gradients(nbytes: float, after: int) -> None:
        """The gradients of ``nbytes`` combined over the data-parallel ranks, once ready."""
        done = s.collective(coll(m.grads, nbytes), after=[after])
        if replicas > 1:
            s.collective(
                net.collective_s("all_reduce", nbytes / group, replicas, min(replicas, sc.nodes)), after=[done]
            )

    def tp_coll(exchange: Exchange | None, after: int) -> list[int]:
        """The exchange after task ``after``, as the list the next layer's compute waits for. A
        replica's ranks are consecutive: its collectives cross nodes only where it does."""
        if exchange is None:
            return []
        seconds = net.collective_s(exchange.op, exchange.nbytes, tp, nodes_for(tp, P // sc.nodes))
        return [s.collective(seconds, after=[after])]

    s = _Schedule(net.overlap)
    total = shape.trainable * b / tp
    if m.gather == "per_unit" or tp > 1:
        # Layer by layer: FSDP's gathers (prefetched) and reduce-scatters, and TP's exchanges, which
        # the next layer waits for (each is on the critical path).
        fsdp = m.gather == "per_unit"
        units = [u * b / tp for u in shape.units]
        exchanges = tp_exchanges(shape, sc.samples_per_rank) if tp > 1 else [(None, None)] * len(units)
        waits: list[int] = []
        for size, (after_forward, _) in zip(units, exchanges, strict=True):
            gathered = [s.collective(coll("all_gather", size))] if fsdp else []
            waits = tp_coll(after_forward, s.compute(forward * size / total, after=gathered + waits))
        gather = [s.collective(coll("all_gather", units[-1]))] if fsdp else []
        for i in reversed(range(len(units))):
            prefetch = [s.collective(coll("all_gather", units[i - 1]))] if fsdp and i else []
            done = s.compute(backward * units[i] / total, after=gather + waits)
            waits = tp_coll(exchanges[i][1], done)
            if m.grads != "none":
                reduce_gradients(units[i], done)
            gather = prefetch
    else:
        gathered = [s.collective(coll("all_gather", shape.params * b))] if m.gather == "before_forward" else []
        s.compute(forward, after=gathered)
        if m.grads == "ddp_buckets":
            for size in ddp_buckets([t * b for t in shape.tensors], m.bucket_bytes):
                s.collective(coll("all_reduce", size), after=[s.compute(backward * size / total)])
        else:
            done = s.compute(backward)
            if m.grads != "none":
                reduce_gradients(total, done)
    if m.norm:
        s.collective(coll("all_reduce", b), after=s.everything())
    shard = total / group if m.sharded_state else total
    if m.offload:
        s.add(net.host_s(shard), comm=True, after=s.everything())
    updated = s.compute(optimizer, after=s.everything())
    if m.offload:
        s.add(net.host_s(shard), comm=True, after=[updated])
    if m.gather == "after_step":
        s.collective(coll("all_gather", total), after=[updated])
    probe_overhead = None
    if sc.probe and P > 1:
        reduce_all = sum(coll("all_reduce", t * b) for t in shape.tensors)
        probe_overhead = reduce_all / (forward + reduce_all)
        s.compute(forward, after=s.everything())
        s.add(0.5 * reduce_all, comm=True, after=s.everything())
        s.collectives += len(shape.tensors) / 2
    s.add(profile.data_s + profile.overhead_s, after=s.everything())
    state = model_state(m, shape, P, per_node)
    return Projection(
        strategy=m.label,
        ranks=P,
        nodes=sc.nodes,
        samples_per_rank=sc.samples_per_rank,
        step_s=s.makespan,
        compute_s=s.compute_s,
        data_s=profile.data_s,
        comm_s=s.comm_s,
        exposed_s=max(0.0, s.makespan - s.compute_s - profile.data_s),
        collectives=s.collectives,
        state=state,
        host_bytes=state["optimizer"] + state["master_params"] if m.offload else 0.0,
        profile=profile.source,
        probe_overhead=probe_overhead,
        tp=tp,
    )


def nodes_for(ranks: int, ranks_per_node: int) -> int:
    return max(1, math.ceil(ranks / ranks_per_node))


def project(
    strategies: Sequence[StrategyModel],
    shape: ModelShape,
    profiles: dict[str, ComputeProfile],
    net: Network,
    ranks: Sequence[int],
    ranks_per_node: int,
    *,
    micro_batch: float | None = None,
    global_batch: float | None = None,
    compute_scale: float = 1.0,
    contention: float = 1.0,
    probe: bool = False,
) -> list[Projection]:
    """Every strategy at every rank count, with speedup and efficiency against the same strategy
    at one rank. The per-rank batch is fixed (``micro_batch``, default the profile's) unless
    ``global_batch`` is: then each rank gets global_batch / P samples (strong scaling)."""

    def one(m: StrategyModel, profile: ComputeProfile, p: int) -> Projection:
        replicas = p // m.tp_ranks(p)
        per_rank = global_batch / replicas if global_batch else (micro_batch or profile.samples)
        scenario = Scenario(p, nodes_for(p, ranks_per_node), per_rank, compute_scale, contention, probe)
        return project_step(m, shape, profile, net, scenario)

    rows = []
    for m in strategies:
        profile = profiles.get(m.label) or profiles["*"]
        base = one(m, profile, 1)
        for p in ranks if m.multi_rank else [1]:
            r = one(m, profile, p)
            speedup = r.samples_per_s / base.samples_per_s
            rows.append(replace(r, speedup=speedup, efficiency=speedup / p))
    return rows


def search_limit(net: Network, ranks_per_node: int) -> int:
    """The most ranks the takeover search tries: one node's without an inter-node link."""
    return TAKEOVER_SEARCH if net.has("inter") else ranks_per_node


def takeover(
    m: StrategyModel,
    shape: ModelShape,
    profile: ComputeProfile,
    net: Network,
    ranks_per_node: int,
    *,
    micro_batch: float | None = None,
    global_batch: float | None = None,
    compute_scale: float = 1.0,
    contention: float = 1.0,
    probe: bool = False,
) -> int | None:
    """The smallest power-of-two rank count (up to search_limit) at which projected exposed
    communication exceeds projected compute; None if none does. With a fixed per-rank batch and no
    bookkeeping this is also where efficiency falls below 50%."""
    p = 2
    while p <= search_limit(net, ranks_per_node):
        (r,) = project(
            [m],
            shape,
            {"*": profile},
            net,
            [p],
            ranks_per_node,
            micro_batch=micro_batch,
            global_batch=global_batch,
            compute_scale=compute_scale,
            contention=contention,
            probe=probe,
        )
        if r.exposed_s > r.compute_s:
            return p
        p *= 2
    return None
