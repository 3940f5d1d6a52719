"""``kanscale recommend``: which strategy, layout and micro-batch to train an experiment's KAN
with on a target (a cluster file, or this machine), predicted from short measurements here and
the projection model, explained, and checked against real runs with ``--validate``.

The steps: every candidate strategy trains briefly on one rank here (launchers/recommend/probe.py:
compute, bookkeeping and what a process holds beside the model state); the target's links come
from its cluster file or are measured now (launchers/recommend/target.py); each strategy is laid
out on the target at the largest micro-batch that fits (analysis/projection/advice.py) and ranked;
the top pick's ``kanscale run`` command is printed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from analysis import projection as pj
from analysis.projection.advice import (
    Candidate,
    Target,
    assumption_lines,
    lay_out,
    measured_ends,
    one_device_verdict,
    ranked,
)
from analysis.projection.memory import StepMemory, peak_memory
from analysis.report.documents import json_out
from analysis.report.format import human_bytes
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import preset_names
from launchers.recommend.checkpointing import checkpointing_lines
from launchers.recommend.one_device import on_device, one_device
from launchers.recommend.probe import (
    PROBE_SETTINGS,
    Probe,
    compute_spread,
    device_step_memory,
    probe_micro_batch,
    probe_study,
    read_probe,
)
from launchers.recommend.rehearsed import rehearsed_probe
from launchers.recommend.step_ops import count_step_ops
from launchers.recommend.target import ClusterFile, cluster_target, memory_here, read_cluster, this_machine
from launchers.recommend.widths import largest_widths
from launchers.zoo import model_shape
from strategies.experiment import ExperimentConfig, experiment_path, load_experiment, load_strategy

logger = log.get(__name__)


@dataclass
class RecommendRequest:
    config: str
    overrides: list[str] = field(default_factory=list)
    cluster: str | None = None
    network: list[str] | None = None
    nproc_per_node: int | None = None
    nnodes: int | None = None
    global_batch: int | None = None
    memory_per_device: float | None = None
    strategies: str | None = None
    contention: float | None = None  # None: as commbench measured ranks sharing this machine
    validate: int = 0
    json: str | None = None
    out: str = "runs/recommend"


@dataclass(frozen=True)
class Recommendation:
    target: Target
    experiment: ExperimentConfig
    shape: pj.ModelShape
    global_batch: int
    candidates: list[Candidate]
    excluded: dict[str, str]
    probe: Probe
    assumptions: list[str]
    command: list[str] | None
    one_device: Candidate | None = None  # the one-process reference on one device, where ranks > 1
    checkpointing: list[str] = field(default_factory=list)  # what checkpointing would let fit (checkpointing.py)

    @property
    def pick(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def verdict(self) -> str | None:
        return one_device_verdict(self.pick, self.one_device, self.target.ranks)


def check_request(r: RecommendRequest) -> None:
    """The flags, before anything is measured."""
    numbers = {
        "--nproc-per-node": r.nproc_per_node,
        "--nnodes": r.nnodes,
        "--global-batch": r.global_batch,
        "--memory-per-device": r.memory_per_device,
        "--contention": r.contention,
    }
    bad = [flag for flag, value in numbers.items() if value is not None and value <= 0]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: must be positive")
    if r.validate < 0:
        raise ConfigError(f"--validate: the number of top picks to train, 0 or more; got {r.validate}")
    if r.validate and (r.cluster or (r.nnodes or 1) > 1):
        raise ConfigError(
            "--validate trains the picks on this machine, one node; drop --cluster and --nnodes to "
            "validate, or drop --validate to predict for the cluster"
        )
    if r.cluster and r.network:
        raise ConfigError("--cluster and --network both describe the links; give one")
    if r.json:
        json_out(r.json, "--json")


def candidate_strategies(
    r: RecommendRequest, cfg: ExperimentConfig, ranks: int, per_node: int, shape: pj.ModelShape
) -> tuple[dict[str, pj.StrategyModel], dict[str, str]]:
    """The strategies laid out, by the name that loads them (a preset, or a preset file): those
    named, or every shipped preset, less those that cannot run this model at ``ranks`` ranks,
    ``per_node`` on each node, or that the projection does not model, each with why."""
    names = [s.strip() for s in r.strategies.split(",") if s.strip()] if r.strategies else preset_names("strategies")
    if not names:
        raise ConfigError("--strategies: name at least one preset, e.g. --strategies ddp,zero2,fsdp2")
    kept: dict[str, pj.StrategyModel] = {}
    excluded: dict[str, str] = {}
    for name in names:
        strategy = load_strategy(name, cfg.model, "--strategies")
        m = strategy.cost_model()
        if m is None:
            excluded[name] = "the projection does not model its options yet (docs/projection.md)"
        elif not m.multi_rank and ranks > 1:
            excluded[name] = f"trains on one rank; the target has {ranks}"
        elif m.tp != 1 and not shape.widths:
            excluded[name] = f"cuts layers that declare how (bspline, rbf, chebyshev); {shape.label} does not"
        else:
            try:
                strategy.mesh_shape(ranks, per_node)
                strategy.preflight(cfg.training, "cpu", ranks)
                kept[name] = m
            except ConfigError as err:
                excluded[name] = str(err)
    if not kept:
        raise ConfigError(
            f"--strategies: none of {', '.join(names)} can be laid out for this model at {ranks} ranks: "
            + "; ".join(f"{k}: {v}" for k, v in excluded.items())
        )
    return kept, excluded


def check_state_fits(
    models: dict[str, pj.StrategyModel],
    shape: pj.ModelShape,
    ranks: int,
    per_node: int,
    capacity: float,
    offload_on_device: bool,
) -> None:
    """Refuse, before anything is measured, a model whose state and gathers alone exceed every
    rank's memory under every candidate: nothing the probes could measure would make it fit. The
    refusal names the ranks that would fit it, or says that no number of ranks would (what a step
    gathers whole, a layer under FSDP, does not shrink with the ranks)."""
    nothing = StepMemory("none", 0.0, 0.0)

    def least(p: int) -> tuple[float, str]:
        return min(
            (peak_memory(m, shape, p, 0, nothing, offload_on_device, per_node).total, name)
            for name, m in models.items()
        )

    need, name = least(ranks)
    if need <= capacity:
        return
    enough = next((p for p in (ranks * 2**i for i in range(1, 17)) if least(p)[0] <= capacity), None)
    fix = (
        f"give at least {enough} ranks (--nnodes, --nproc-per-node), a smaller model (model.widths, model.grid), "
        "or devices with more memory"
        if enough
        else "more ranks do not help (what a step holds whole, a layer's parameters under FSDP, does not shrink with "
        "them): give a smaller model (model.widths, model.grid) or devices with more memory"
    )
    raise ConfigError(
        f"--memory-per-device: {shape.label} fits nowhere: its model state and what the backend gathers "
        f"under {name}, the least of the candidates, take {human_bytes(need)} per rank at {ranks} ranks, "
        f"and a rank has {human_bytes(capacity)}; {fix}"
    )


def global_batch_of(r: RecommendRequest, cfg: ExperimentConfig, ranks: int) -> int:
    t = cfg.training
    if r.global_batch:
        return r.global_batch
    if t.global_batch:
        return t.global_batch
    return (t.micro_batch or 1) * t.grad_accum * ranks


def probe_names(models: dict[str, pj.StrategyModel], cfg: ExperimentConfig) -> list[str]:
    """The strategies trained on one rank for the probe: the one-process reference (whose probe a
    strategy without its own takes) and each candidate that one rank can start (a fixed TP degree
    above 1 cannot), but a hybrid one whose full-sharding sibling is probed (the same code there)."""
    reference = next(name for name in preset_names("strategies") if load_strategy(name, cfg.model).reference)
    labels = {m.label for m in models.values()}
    return [
        reference,
        *(name for name, m in models.items() if name != reference and m.tp in (0, 1) and m.one_rank_as not in labels),
    ]


def run_probe(r: RecommendRequest, cfg: ExperimentConfig, labels: list[str], micro_batch: int) -> Probe:
    from launchers.studies.sweep import run_sweep

    study, out = probe_study(experiment_path(r.config), r.overrides, labels, micro_batch, Path(r.out) / "probe")
    logger.info(
        f"[recommend] 1-rank probes of {', '.join(labels)} at {micro_batch} samples per step, "
        f"{PROBE_SETTINGS['training.steps']} steps each"
    )
    results = run_sweep(str(study), str(out), resume=out.exists(), overrides=r.overrides, progress=False)
    failed = [res for res in results if res.status not in ("ok", "skipped")]
    for res in failed:
        logger.warning(f"probe {res.point}: {res.status}: {res.detail}")
    try:
        return read_probe(out, device_step_memory(cfg, micro_batch), micro_batch)
    except ValueError as err:
        raise ConfigError(f"the 1-rank probes under {out} finished none ({err}); see {out}/logs") from None


def layout(r: RecommendRequest, cluster: ClusterFile | None) -> tuple[int, int]:
    """Ranks per node (the flag, the cluster file's, else 2 here) and ranks in all."""
    per_node = r.nproc_per_node or (cluster.ranks_per_node if cluster else 2)
    return per_node, (r.nnodes or 1) * per_node


def recommend(r: RecommendRequest) -> Recommendation:
    check_request(r)
    # the cluster file first: a mistake in it is found before anything else is read or measured
    cluster = read_cluster(r.cluster, r.memory_per_device, r.nnodes or 1, r.nproc_per_node) if r.cluster else None
    cfg = load_experiment(r.config, r.overrides)
    # the precision decides what a backend that casts the module holds (StrategyModel.casts_module)
    shape = replace(model_shape(cfg.model.model_dump()), precision=cfg.training.precision)
    per_node, ranks = layout(r, cluster)
    models, excluded = candidate_strategies(r, cfg, ranks, per_node, shape)
    capacity = cluster.memory_per_rank if cluster else memory_here(per_node, r.memory_per_device)
    check_state_fits(models, shape, ranks, per_node, capacity, offload_on_device=cluster is None)
    global_batch = global_batch_of(r, cfg, ranks)
    micro_batch = probe_micro_batch(shape.trainable, max(1, global_batch // ranks))
    if cluster and cluster.per_kernel:  # a GPU's step is its kernels: rehearsed, nothing timed here
        probe, models, refused = rehearsed_probe(
            r.config, r.overrides, cfg, shape, models, (r.nnodes or 1, per_node), global_batch, micro_batch, Path(r.out)
        )
        excluded = {**excluded, **refused}
    else:
        probe = run_probe(r, cfg, probe_names(models, cfg), micro_batch)
    return advise(r, cfg, shape, models, excluded, probe, cluster)


def advise(
    r: RecommendRequest,
    cfg: ExperimentConfig,
    shape: pj.ModelShape,
    models: dict[str, pj.StrategyModel],
    excluded: dict[str, str],
    probe: Probe,
    cluster: ClusterFile | None,
) -> Recommendation:
    """From the probes to the answer: the target at every end of the inputs' ranges, each
    strategy laid out and ranked, the one-device yardstick, the assumptions and the command."""
    per_node, ranks = layout(r, cluster)
    global_batch = global_batch_of(r, cfg, ranks)
    spread = compute_spread(probe.runs)
    # what is measured here, at every end of ENDS: its times within the probes' spread
    compute = {label: measured_ends(p, spread) for label, p in probe.compute.items()}
    precision = cfg.training.precision

    def rehearsed(label: str) -> bool:  # its own rank's step, not the whole model's
        return label != "*" and label in probe.steps

    step = None
    if cluster:
        # a GPU's step is its kernels: counted here at the target's per-rank micro-batch, each at its cost there
        if cluster.per_kernel:
            step = probe.steps.get("*") or count_step_ops(cfg.model, cfg.training, max(1, global_batch // ranks))
        target = cluster_target(cluster, r.nnodes, per_node, 6 * shape.trainable, compute["*"], step, precision, spread)
        if step is not None:  # each strategy's own kernels where rehearsed, else the model's
            compute = {
                label: on_device(cluster, probe.steps.get(label, step), ends, precision, per_rank=rehearsed(label))
                for label, ends in compute.items()
            }
    else:
        reference = compute["*"]["value"]  # a rank's compute per step, where the shared cores are read
        step_compute = reference.compute_s * max(1, global_batch // ranks) / reference.samples
        target = this_machine(per_node, r.memory_per_device, r.network, Path(r.out), r.contention, step_compute, spread)

    def beside(m: pj.StrategyModel) -> StepMemory:  # a GPU's allocator holds no process, a CPU rank's RSS does
        own = stand_in(m, probe, models)
        memory = probe.beside[own] if target.offload_on_device else probe.device
        if own in probe.counters:  # rehearsed at the target's layout
            return replace(memory, counters=probe.counters[own])
        measured = probe.optimizer_bytes.get(own)
        counters = measured - pj.model_state(m, shape, 1)["optimizer"] if measured is not None else 0.0
        return replace(memory, counters=max(0.0, counters))

    def lay_out_here(m: pj.StrategyModel, per_sample: float | None = None) -> Candidate:
        memory = beside(m) if per_sample is None else replace(beside(m), per_sample=per_sample)
        return lay_out(m, shape, compute[stand_in(m, probe, models)], memory, target, global_batch)

    laid_out = []
    for m in models.values():
        c = lay_out_here(m)
        widest, beyond = largest_widths(m, cfg, c, target, beside(m))
        laid_out.append(replace(c, largest_widths=widest, widths_beyond=beyond))
    candidates = ranked(laid_out)
    one = one_device(cfg, shape, compute["*"], beside, target, global_batch, cluster, step, r.memory_per_device)
    rehearsals = [f"{label}: {source}" for label, source in probe.sources.items()]
    load = probe.outside_load_words() if cluster is None else None  # a cluster's ranks are not this machine's
    # where rehearsed, each strategy's own kernels are named below, with where they came from
    profiles = {k: v["value"] for k, v in compute.items() if k == "*" or not probe.steps}
    notes = pj.assumptions(
        shape,
        profiles,
        target.network,
        target.compute_scale,
        target.contention,
        False,
        memory="memory below",
    )
    by_label = {m.label: m for m in models.values()}
    checkpointing = checkpointing_lines(
        cfg, probe.micro_batch, candidates, lambda c, per_sample: lay_out_here(by_label[c.strategy], per_sample)
    )
    recommendation = Recommendation(
        target,
        cfg,
        shape,
        global_batch,
        candidates,
        excluded,
        probe,
        notes + assumption_lines(target) + rehearsals + ([load] if load else []),
        None,
        one,
        checkpointing,
    )
    return Recommendation(**{**recommendation.__dict__, "command": run_command(r, recommendation)})


def stand_in(m: pj.StrategyModel, probe: Probe, models: dict[str, pj.StrategyModel]) -> str:
    """Whose probe a strategy's prediction starts from: its own; a hybrid one its full-sharding
    sibling's (the same code at one rank); for one that cuts layers without its own (fsdp2_tp,
    whose TP degree one rank cannot start), a probed one that cuts layers (tp), whose DTensor
    bookkeeping it shares; else the one-process reference's (``*``)."""
    probed = [label for label in probe.compute if label in probe.beside]
    cutting = [o.label for o in models.values() if o.tp != 1 and o.label in probed]
    if m.label in probed:
        return m.label
    if m.one_rank_as in probed:
        return m.one_rank_as
    return cutting[0] if m.tp != 1 and cutting else "*"


def run_command(r: RecommendRequest, rec: Recommendation) -> list[str] | None:
    """The ``kanscale run`` line that trains the pick as recommended."""
    pick = rec.pick
    if pick is None:
        return None
    command = [
        "kanscale",
        "run",
        r.config,
        *(f for o in r.overrides for f in ("--set", o)),
        "--strategy",
        pick.strategy,
        "--nproc-per-node",
        str(rec.target.ranks_per_node),
    ]
    if rec.target.nodes > 1:  # nodes meet where a scheduler places them: one sbatch script
        command += ["--nnodes", str(rec.target.nodes), "--launcher", "slurm"]
    if not rec.target.offload_on_device:  # a cluster file's ranks are GPUs
        command += ["--slurm-device", "cuda"] if rec.target.nodes > 1 else ["--set", "runtime.device=cuda"]
    command += [
        "--set",
        f"training.global_batch={rec.global_batch}",
        "--set",
        "training.micro_batch=null",
        "--set",
        f"training.grad_accum={pick.grad_accum}",
    ]
    return command
