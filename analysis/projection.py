"""Scaling projection: step time, speedup, parallel efficiency, exposed communication and per-rank
model-state bytes of every strategy at P ranks over N nodes, from a measured compute profile and a
network description (``kanscale commbench`` fits or a cluster file). Pure functions on numbers:
nothing here starts a process group.

Everything this module produces is a projection, not a measurement; docs/projection.md states the
model, its assumptions and how far it lands from measured runs.

Cost of one collective of S bytes (the full buffer, as nccl-tests counts it) over P ranks on a
link with per-step latency alpha and inverse bus bandwidth beta (a ring; nccl-tests'
doc/PERFORMANCE.md for the factors):

    all-reduce          2 (P - 1) alpha + 2 (P - 1) / P * S * beta
    reduce-scatter        (P - 1) alpha +   (P - 1) / P * S * beta
    all-gather            (P - 1) alpha +   (P - 1) / P * S * beta

Ranks spanning several nodes form one flat ring whose every step waits for its slowest hop, the
inter-node one, so the inter-node alpha and beta apply to the whole collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.format import human_bytes
from analysis.load import load_runs
from analysis.records import SUMMARY_FILE, read_summary
from analysis.schema import RunRecord
from analysis.tables import count, fixed, percent

MiB = 1 << 20
OPS = ("all_reduce", "reduce_scatter", "all_gather")
HOST_COPY = "host_copy"  # commbench's per-rank host copy: the link ZeRO's offload uses
ADAM_BYTES_PER_PARAM = 8  # two fp32 moments
DDP_FIRST_BUCKET = 1 * MiB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 * MiB  # bucket_cap_mb of configs/strategies/ddp.yaml
TAKEOVER_SEARCH = 4096  # largest rank count the takeover search tries
PAPER_BATCH = 512  # samples per GPU per step in the published study (reference/README.md)


# --- collectives ---------------------------------------------------------------------------------

def busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "all_gather"):
        return (ranks - 1) / ranks
    if op == HOST_COPY:
        return 1.0
    raise ValueError(f"unknown operation {op!r}; expected one of {', '.join(OPS + (HOST_COPY,))}")


def ring_steps(op: str, ranks: int) -> int:
    """Latency-bound steps of a ring: each pays one link latency."""
    if op == HOST_COPY:
        return 1
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1


@dataclass(frozen=True)
class Fit:
    """time = alpha + beta * bytes for one operation at the measured rank count."""

    alpha_s: float
    beta_s_per_byte: float
    rel_rms: float  # root mean square of the relative residuals

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Fit:
    """Least squares of time = alpha + beta * bytes on relative residuals (each point weighted by
    1 / its time). Message sizes span six orders of magnitude: unweighted, the largest messages
    alone would set both parameters and alpha, visible only at small sizes, would be noise.
    Neither may be negative; one that comes out negative is fixed at 0 and the other refitted."""
    s, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(np.unique(s)) < 2 or np.any(t <= 0):
        raise ValueError("fitting alpha and beta needs at least two message sizes with positive times")

    def solve(*columns: np.ndarray) -> np.ndarray:
        return np.linalg.lstsq(np.stack(columns, axis=1) / t[:, None], np.ones_like(t), rcond=None)[0]

    alpha, beta = solve(np.ones_like(s), s)
    if alpha < 0:
        alpha, beta = 0.0, solve(s)[0]
    elif beta < 0:
        alpha, beta = solve(np.ones_like(s))[0], 0.0
    residual = (alpha + beta * s - t) / t
    return Fit(float(alpha), float(beta), float(np.sqrt(np.mean(residual ** 2))))


@dataclass(frozen=True)
class LinkCost:
    """One link as the ring model sees it: latency per ring step, inverse bus bandwidth."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_fit(cls, op: str, fit: Fit, ranks: int) -> "LinkCost":
        """The link behind an operation's fit at ``ranks``: alpha over the ring's steps, beta over
        the bus-bandwidth factor (so 1 / beta is the bus bandwidth)."""
        return cls(fit.alpha_s / ring_steps(op, ranks), fit.beta_s_per_byte / busbw_factor(op, ranks))

    def seconds(self, op: str, nbytes: float, ranks: int) -> float:
        if ranks <= 1 and op != HOST_COPY:
            return 0.0
        return ring_steps(op, ranks) * self.alpha_s + busbw_factor(op, ranks) * nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Network:
    """Link costs by (link, operation); link is intra, inter or host, operation one of OPS,
    host_copy, or ``any`` (a cluster file gives one cost per link)."""

    source: str
    links: dict[tuple[str, str], LinkCost]
    ranks_per_node: int
    overlap: bool  # can collectives run while the rank computes (GPU streams), or not (CPU ranks)
    host_optimizer_slowdown: float = 1.0  # offloaded optimizer step on the host vs on the device

    def cost(self, link: str, op: str) -> LinkCost:
        found = self.links.get((link, op)) or self.links.get((link, "any"))
        if found is None:
            have = sorted({name for name, _ in self.links})
            raise ValueError(f"no {link} link in {self.source} (it has: {', '.join(have)}); "
                             + ("run kanscale commbench --nnodes 2 for an inter-node one and pass both files"
                                if link == "inter" else "measure it with kanscale commbench or give a cluster file"))
        return found

    def has(self, link: str) -> bool:
        return any(name == link for name, _ in self.links)

    def collective_s(self, op: str, nbytes: float, ranks: int, nodes: int) -> float:
        return 0.0 if ranks <= 1 else self.cost("inter" if nodes > 1 else "intra", op).seconds(op, nbytes, ranks)

    def host_s(self, nbytes: float) -> float:
        return self.cost("host", HOST_COPY).seconds(HOST_COPY, nbytes, 1)


# --- what is trained and how fast ------------------------------------------------------------------

@dataclass(frozen=True)
class ComputeProfile:
    """Per-rank compute of one optimizer step on one device, as measured."""

    source: str
    samples: float  # per-rank samples of the measured step
    compute_s: float  # forward + backward; + the optimizer step where it was not measured apart
    optimizer_s: float = 0.0  # the optimizer step over the whole model, where measured apart
    data_s: float = 0.0  # fetching the step's batch
    overhead_s: float = 0.0  # the rest of a 1-rank step: the strategy's own bookkeeping
    forward_fraction: float = 1 / 3  # forward's share of compute_s
    forward_source: str = "assumed"  # measured | given | assumed


@dataclass(frozen=True)
class ModelShape:
    """Element counts (fp32) of a model's parameters, from the zoo (strategies.commbench.model_shape)."""

    label: str
    tensors: tuple[int, ...]  # trainable elements per parameter tensor, in registration (forward) order
    units: tuple[int, ...]  # trainable elements per sharding unit: the root's own, then each KAN layer
    params: int  # every parameter element, frozen ones included (pykan's grids and masks)
    dtype_bytes: int = 4

    @property
    def trainable(self) -> int:
        return sum(self.tensors)


# --- strategies ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StrategyModel:
    grads: str  # how gradients are combined: none | ddp_buckets | all_reduce | reduce_scatter (one collective each)
    gather: str = "none"  # parameter all-gathers: none | after_step | before_forward | per_unit (forward and backward)
    sharded_state: bool = False  # gradients and optimizer state sharded 1/P
    sharded_params: str = "none"  # none | trainable (FSDP leaves frozen ones whole) | all (ZeRO-3)
    master: bool = False  # ZeRO's fp32 master partition
    norm: bool = False  # DeepSpeed's all-reduce of the gradient norm, one float per step
    offload: bool = False  # optimizer state and step on the host


# What the suite's presets issue per optimizer step, as counted on 2 ranks (docs/projection.md):
# DDP all-reduces its buckets; DeepSpeed 0.19 (configs/deepspeed: overlap_comm off, 500 MB buckets,
# so one collective per kind for every zoo model) all-reduces the gradients in stages 1 and 2
# (use_multi_rank_bucket_allreduce) and all-gathers the updated partitions, and in stage 3 gathers
# every parameter once before forward (one prefetch bucket, kept through backward:
# stage3_max_reuse_distance) and reduce-scatters the gradients; FSDP gathers each KAN layer
# before its forward and again before its backward and reduce-scatters its gradients.
STRATEGIES: dict[str, StrategyModel] = {
    "single": StrategyModel(grads="none"),
    "ddp": StrategyModel(grads="ddp_buckets"),
    "zero1": StrategyModel(grads="all_reduce", gather="after_step", sharded_state=True, master=True, norm=True),
    "zero2": StrategyModel(grads="all_reduce", gather="after_step", sharded_state=True, master=True, norm=True),
    "zero3": StrategyModel(grads="reduce_scatter", gather="before_forward", sharded_state=True, sharded_params="all",
                           master=True, norm=True),
    "zero3-offload": StrategyModel(grads="reduce_scatter", gather="before_forward", sharded_state=True,
                                   sharded_params="all", master=True, norm=True, offload=True),
    "fsdp1": StrategyModel(grads="reduce_scatter", gather="per_unit", sharded_state=True, sharded_params="trainable"),
    "fsdp2": StrategyModel(grads="reduce_scatter", gather="per_unit", sharded_state=True, sharded_params="trainable"),
}


def model_state(strategy: str, shape: ModelShape, ranks: int) -> dict[str, float]:
    """Bytes per rank as the suite's records count them (docs/metrics.md): fp32 parameters,
    gradients, Adam's two moments, ZeRO's fp32 master partition; padding ignored."""
    m, b = STRATEGIES[strategy], shape.dtype_bytes
    trainable, frozen = shape.trainable * b, (shape.params - shape.trainable) * b
    params = {"none": trainable + frozen, "trainable": trainable / ranks + frozen,
              "all": (trainable + frozen) / ranks}[m.sharded_params]
    state_share = 1 / ranks if m.sharded_state else 1.0
    return {"params": params, "grads": trainable * state_share,
            "optimizer": ADAM_BYTES_PER_PARAM * shape.trainable * state_share,
            "master_params": trainable / ranks if m.master else 0.0}


def ddp_buckets(tensor_bytes: Sequence[float], cap: float = DDP_BUCKET, first: float = DDP_FIRST_BUCKET) -> list[float]:
    """DDP's gradient buckets in the order they fill: tensors in reverse registration order, a
    bucket closes once it reaches its cap (1 MiB for the first, bucket_cap_mb after)."""
    buckets, current, limit = [], 0.0, min(first, cap)
    for size in reversed(tensor_bytes):
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0.0, cap
    return buckets + ([current] if current else [])


class _Schedule:
    """Tasks on two lanes, compute and communication, each serial, with dependencies. Without
    overlap both share one lane, so everything adds up."""

    def __init__(self, overlap: bool) -> None:
        self.overlap, self.done, self.free = overlap, [], {False: 0.0, True: 0.0}
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
        return self.ranks * self.samples_per_rank / self.step_s


def project_step(strategy: str, shape: ModelShape, profile: ComputeProfile, net: Network, sc: Scenario) -> Projection:
    """One optimizer step of ``strategy`` on one rank, the collectives as in STRATEGIES.

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
    m, P, b = STRATEGIES[strategy], sc.ranks, shape.dtype_bytes
    speed = sc.compute_scale * (sc.contention if P > 1 else 1.0)
    work = profile.compute_s * sc.samples_per_rank / profile.samples * speed
    forward, backward = profile.forward_fraction * work, (1 - profile.forward_fraction) * work
    optimizer = profile.optimizer_s * speed / (P if m.sharded_state else 1)
    if m.offload:
        optimizer *= net.host_optimizer_slowdown

    def coll(op: str, nbytes: float) -> float:
        return net.collective_s(op, nbytes, P, sc.nodes)

    s = _Schedule(net.overlap)
    total = shape.trainable * b
    if m.gather == "per_unit":
        units = [u * b for u in shape.units]
        for size in units:
            s.compute(forward * size / total, after=[s.collective(coll("all_gather", size))])
        gather = s.collective(coll("all_gather", units[-1]))
        for i in reversed(range(len(units))):
            prefetch = s.collective(coll("all_gather", units[i - 1])) if i else None
            done = s.compute(backward * units[i] / total, after=[gather])
            s.collective(coll(m.grads, units[i]), after=[done])
            gather = prefetch
    else:
        gathered = [s.collective(coll("all_gather", shape.params * b))] if m.gather == "before_forward" else []
        s.compute(forward, after=gathered)
        if m.grads == "ddp_buckets":
            for size in ddp_buckets([t * b for t in shape.tensors]):
                s.collective(coll("all_reduce", size), after=[s.compute(backward * size / total)])
        else:
            done = s.compute(backward)
            if m.grads != "none":
                s.collective(coll(m.grads, total), after=[done])
    if m.norm:
        s.collective(coll("all_reduce", b), after=s.everything())
    shard = total / P if m.sharded_state else total
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
    state = model_state(strategy, shape, P)
    return Projection(
        strategy=strategy, ranks=P, nodes=sc.nodes, samples_per_rank=sc.samples_per_rank, step_s=s.makespan,
        compute_s=s.compute_s, data_s=profile.data_s, comm_s=s.comm_s,
        exposed_s=max(0.0, s.makespan - s.compute_s - profile.data_s), collectives=s.collectives, state=state,
        host_bytes=state["optimizer"] + state["master_params"] if m.offload else 0.0, profile=profile.source,
        probe_overhead=probe_overhead)


def nodes_for(ranks: int, ranks_per_node: int) -> int:
    return max(1, math.ceil(ranks / ranks_per_node))


def project(strategies: Sequence[str], shape: ModelShape, profiles: dict[str, ComputeProfile], net: Network,
            ranks: Sequence[int], ranks_per_node: int, *, micro_batch: float | None = None,
            global_batch: float | None = None, compute_scale: float = 1.0, contention: float = 1.0,
            probe: bool = False) -> list[Projection]:
    """Every strategy at every rank count, with speedup and efficiency against the same strategy
    at one rank. The per-rank batch is fixed (``micro_batch``, default the profile's) unless
    ``global_batch`` is: then each rank gets global_batch / P samples (strong scaling)."""
    rows = []
    for strategy in strategies:
        profile = profiles.get(strategy) or profiles["*"]

        def one(p: int) -> Projection:
            per_rank = global_batch / p if global_batch else (micro_batch or profile.samples)
            return project_step(strategy, shape, profile, net,
                                Scenario(p, nodes_for(p, ranks_per_node), per_rank, compute_scale, contention, probe))

        base = one(1)
        for p in ranks if strategy != "single" else [1]:
            r = one(p)
            speedup = r.samples_per_s / base.samples_per_s
            rows.append(replace(r, speedup=speedup, efficiency=speedup / p))
    return rows


def search_limit(net: Network, ranks_per_node: int) -> int:
    """The most ranks the takeover search tries: one node's without an inter-node link."""
    return TAKEOVER_SEARCH if net.has("inter") else ranks_per_node


def takeover(strategy: str, shape: ModelShape, profile: ComputeProfile, net: Network, ranks_per_node: int, *,
             micro_batch: float | None = None, global_batch: float | None = None, compute_scale: float = 1.0,
             contention: float = 1.0, probe: bool = False) -> int | None:
    """The smallest power-of-two rank count (up to search_limit) at which projected exposed
    communication exceeds projected compute; None if none does. With a fixed per-rank batch and no
    bookkeeping this is also where efficiency falls below 50%."""
    p = 2
    while p <= search_limit(net, ranks_per_node):
        (r,) = project([strategy], shape, {"*": profile}, net, [p], ranks_per_node, micro_batch=micro_batch,
                       global_batch=global_batch, compute_scale=compute_scale, contention=contention, probe=probe)
        if r.exposed_s > r.compute_s:
            return p
        p *= 2
    return None


# --- inputs ----------------------------------------------------------------------------------------

def network_from_commbench(docs: Sequence[dict[str, Any]], source: str) -> Network:
    """Link costs from one or more ``kanscale commbench`` JSON documents (e.g. one intra-node and
    one inter-node run). Ranks per node: the largest any of them ran."""
    links = {}
    for doc in docs:
        if doc.get("kind") != "kanscale commbench":
            raise ValueError("not a kanscale commbench JSON (no \"kind\": \"kanscale commbench\")")
        for fit in doc["fits"]:
            links[(fit["link"], fit["op"])] = LinkCost(fit["link_alpha_s"], fit["link_beta_s_per_byte"])
    return Network(source=source, links=links, ranks_per_node=max(d["ranks_per_node"] for d in docs),
                   overlap=all(d["device"] == "cuda" for d in docs))


def network_from_cluster(doc: dict[str, Any], source: str) -> Network:
    """A cluster description (configs/clusters/*.yaml): per link alpha_us (latency per ring step)
    and busbw_GBps (bus bandwidth, 1e9 bytes/s); the host link and the offloaded optimizer's
    slowdown; ranks per node; whether collectives overlap compute."""
    try:
        links = {(name, "any"): LinkCost(v["alpha_us"] * 1e-6, 1 / (v["busbw_GBps"] * 1e9))
                 for name, v in doc["links"].items()}
        return Network(source=source, links=links, ranks_per_node=int(doc["ranks_per_node"]), overlap=bool(doc["overlap"]),
                       host_optimizer_slowdown=float(doc.get("host_optimizer_slowdown", 1.0)))
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as err:
        raise ValueError(f"needs ranks_per_node, overlap and links: {{intra|inter|host: {{alpha_us, busbw_GBps}}}} "
                         f"(see configs/clusters/a100_ib.yaml); problem at {err!s}") from None


def profile_from_record(record: RunRecord, run_dir: str) -> ComputeProfile:
    """A 1-rank run record: compute_s of the compute-only replica (optimizer included), data time,
    and the rest of its step as the strategy's bookkeeping."""
    t = record.timings
    return ComputeProfile(
        source=f"1-rank run {run_dir} ({record.topology.device_name})",
        samples=record.batch.micro_batch * record.batch.grad_accum, compute_s=t.compute_s, data_s=t.data_s,
        overhead_s=max(0.0, t.step_mean_s - t.data_s - t.compute_s))


def median_profile(profiles: Sequence[ComputeProfile], source: str) -> ComputeProfile:
    """Repeated runs of one point: the median of each time."""
    def med(field: str) -> float:
        return float(np.median([getattr(p, field) for p in profiles]))

    return replace(profiles[0], source=source, compute_s=med("compute_s"), data_s=med("data_s"),
                   overhead_s=med("overhead_s"), optimizer_s=med("optimizer_s"))


EXPERIMENT = ["study", "model_label", "task.name", "batch.micro_batch", "batch.grad_accum"]


def profiles_from_runs(directory: str | Path) -> tuple[dict[str, ComputeProfile], dict[str, Any]]:
    """The finished 1-rank runs under ``directory`` (of one experiment): per strategy label the
    median profile of its runs, and under ``*`` (for strategies without a 1-rank run of their
    own) single's, else the median of all without any strategy's bookkeeping. Also the model
    config the runs trained."""
    runs, _ = load_runs(directory)
    ok = runs[(runs["status"] == "ok") & (runs["topology.world_size"] == 1)] if not runs.empty else runs
    if ok.empty:
        raise ValueError(f"{directory} holds no finished 1-rank run; train one (kanscale train CONFIG --out DIR) "
                         "or give a kanscale bench JSON")
    experiments = ok.groupby(EXPERIMENT, dropna=False).size()
    if len(experiments) > 1:
        names = "; ".join(" ".join(str(v) for v in key) for key in experiments.index)
        raise ValueError(f"{directory} holds 1-rank runs of {len(experiments)} experiments ({names}); point it at one "
                         "run directory, or at a directory holding one experiment's runs")
    records = {d: read_summary(Path(d) / SUMMARY_FILE) for d in ok["run_dir"]}
    first = next(iter(records.values()))
    where = f"1-rank runs under {directory} ({first.topology.device_name})"
    profiles = {label: median_profile([profile_from_record(records[d], d) for d in group["run_dir"]],
                                      f"each strategy's own {where}")
                for label, group in ok.groupby("strategy_label")}
    fallback = (replace(profiles["single"], source=f"single's {where}") if "single" in profiles else
                replace(median_profile(list(profiles.values()), f"all {where}"), overhead_s=0.0))
    profiles["*"] = replace(fallback, source=fallback.source + ", for strategies without their own")
    model = first.model
    return profiles, {"family": model.family, "widths": model.widths, **model.options}


def profile_from_bench(doc: dict[str, Any], row: str | None) -> tuple[ComputeProfile, str, str]:
    """One row of a ``kanscale bench`` JSON (``WORKLOAD/IMPL``; optional when it has one row):
    medians of forward, backward and optimizer time (train step - forward - backward, at least 0).
    Returns the profile, the workload and the implementation."""
    if not isinstance(doc, dict) or "workloads" not in doc or "results" not in doc:
        raise ValueError("not a kanscale bench JSON; for run records give the run directory")
    ok = [r for r in doc["results"] if r.get("status") == "ok"]
    names = [f"{r['workload']}/{r['impl']}" for r in ok]
    if row is None and len(ok) != 1:
        raise ValueError(f"pick a row with --row, one of: {', '.join(names) or '(no finished rows)'}")
    chosen = ok[0] if row is None else next((r for r, n in zip(ok, names) if n == row), None)
    if chosen is None:
        raise ValueError(f"no finished row {row!r}; rows: {', '.join(names)}")
    fwd, bwd, step = (chosen[k]["median"] / 1e3 for k in ("forward_ms", "backward_ms", "step_ms"))
    env = doc["environment"]
    source = f"kanscale bench {chosen['workload']}/{chosen['impl']} ({env['gpu'] or env['cpu']}, {env['date'][:10]})"
    profile = ComputeProfile(source=source, samples=chosen["batch"], compute_s=fwd + bwd,
                             optimizer_s=max(0.0, step - fwd - bwd), forward_fraction=fwd / (fwd + bwd),
                             forward_source="measured")
    return profile, chosen["workload"], chosen["impl"]


def paper_profile() -> tuple[ComputeProfile, dict[str, Any]]:
    """The published study's one-GPU run (strong scaling, 1 A100): its whole step, from its
    throughput at 512 samples per step; and the model it trained."""
    from analysis.paper import paper_results

    row = paper_results().set_index("run").loc["strong_scaling_n1g1"]
    profile = ComputeProfile(source=f"published 1-GPU run ({row['throughput_total_sps']} samples/s, A100)",
                             samples=PAPER_BATCH, compute_s=PAPER_BATCH / float(row["throughput_total_sps"]))
    model = {"family": "pykan", "widths": [2, int(row["hidden_width"]), 1], "grid": 10, "k": 3, "seed": 42}
    return profile, model


# --- output ----------------------------------------------------------------------------------------

def assumptions(shape: ModelShape, profiles: dict[str, ComputeProfile], net: Network, compute_scale: float,
                contention: float, probe: bool) -> list[str]:
    any_profile = next(iter(profiles.values()))
    forward = f"{any_profile.forward_source} {any_profile.forward_fraction:.2f}"
    return [
        f"model: {shape.label}, {shape.trainable:,} trainable parameters, fp32, Adam; activations not counted",
        "compute: " + "; ".join(sorted({p.source for p in profiles.values()}))
        + f"; linear in samples per rank; x{compute_scale:g}" + (f", x{contention:g} more when P > 1" if contention != 1
                                                                   else "") + f"; forward share {forward}",
        f"network: {net.source}; a flat ring, inter-node alpha/beta whenever the ranks span nodes",
        "overlap: " + ("DDP buckets and FSDP reduce-scatters beside backward, FSDP gathers prefetched; DeepSpeed's "
                       "collectives block (overlap_comm off)" if net.overlap else "none: collectives and compute add up "
                                                                                  "(CPU ranks)"),
        "1-rank bookkeeping (step - data - compute of a strategy's own 1-rank run) carried over unchanged",
        "published probe: +1 forward and +1/2 all-reduce per gradient tensor per step when P > 1" if probe
        else "no probe",
    ]


def table(rows: Sequence[Projection]) -> pd.DataFrame:
    """The projection as text, the suite's table conventions."""
    ms = fixed(2)
    text = pd.DataFrame([{
        "strategy": r.strategy, "nodes x ranks": f"{r.nodes}x{math.ceil(r.ranks / r.nodes)}",
        "samples / rank": count(r.samples_per_rank), "step ms": ms(1e3 * r.step_s), "compute ms": ms(1e3 * r.compute_s),
        "exposed comm ms": ms(1e3 * r.exposed_s), "comm fraction": percent(r.comm_fraction),
        "speedup": fixed(2)(r.speedup), "efficiency": percent(r.efficiency),
        "model state / rank": human_bytes(r.state_bytes), "of it on host": human_bytes(r.host_bytes) if r.host_bytes else "",
    } for r in rows])
    if any(r.probe_overhead is not None for r in rows):
        text["probe's (t2 - t1) / t2"] = [percent(r.probe_overhead) if r.probe_overhead is not None else "" for r in rows]
    return text


def markdown(rows: Sequence[Projection], notes: Sequence[str], takeovers: dict[str, int | None], limit: int) -> str:
    """The projected table with its assumptions and where communication takes over."""
    lines = ["**Projected** (a model, not a measurement). Assumptions:", ""] + [f"- {n}" for n in notes] + [""]
    lines.append(table(rows).to_markdown(index=False))
    lines += ["", f"Projected rank count at which communication takes over (exposed communication > compute; powers of "
              f"two up to {limit}): " + ", ".join(f"{s} {p if p else f'> {limit}'}" for s, p in takeovers.items())]
    return "\n".join(lines) + "\n"


def document(rows: Sequence[Projection], notes: Sequence[str], takeovers: dict[str, int | None]) -> dict[str, Any]:
    return {"kind": "kanscale projection", "projected": True, "assumptions": list(notes),
            "takeover_ranks": takeovers,
            "rows": [{**asdict(r), "comm_fraction": r.comm_fraction, "state_bytes": r.state_bytes,
                      "samples_per_s": r.samples_per_s} for r in rows]}
