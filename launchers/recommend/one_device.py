"""The yardstick of a recommendation over several ranks: the experiment's one-process reference
(``single``) laid out on one device of the target at the same global batch. Where the model
fits one device and the best multi-rank pick is no faster beyond the intervals, the report says
that one device is the answer (analysis/projection/advice.py, one_device_verdict)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from analysis import projection as pj
from analysis.projection.advice import Candidate, Target, lay_out
from analysis.projection.device_time import StepOps, device_time
from analysis.projection.memory import StepMemory
from analysis.projection.uncertainty import ENDS
from kanscale.files import preset_names
from launchers.recommend.step_ops import count_step_ops
from launchers.recommend.target import ClusterFile, device_profile, memory_here
from strategies.experiment import ExperimentConfig, load_strategy


def on_device(
    cluster: ClusterFile, step: StepOps, measured: dict[str, pj.ComputeProfile], precision: str, per_rank: bool = False
) -> dict[str, pj.ComputeProfile]:
    """A rank's compute on the cluster's device at every end of ENDS, from the counted kernels
    (``per_rank``: one rank's, rehearsed) and what is measured here at that end (its data time)."""
    return {end: device_profile(cluster, step, measured[end], precision, end, per_rank) for end in ENDS}


def one_device(
    cfg: ExperimentConfig,
    shape: pj.ModelShape,
    reference: dict[str, pj.ComputeProfile],
    beside: Callable[[pj.StrategyModel], StepMemory],
    target: Target,
    global_batch: int,
    cluster: ClusterFile | None,
    step: StepOps | None,
    memory_per_device: float | None,
) -> Candidate | None:
    """The one-process reference on one device of the target, at every end of ENDS (``reference``:
    its compute, as the candidates' is); None at one rank, where there is nothing to compare.
    On a GPU a step of few kernels does not shrink with its samples, so its kernels are counted
    again at the one device's micro-batch."""
    if target.ranks <= 1:
        return None
    name = next(n for n in preset_names("strategies") if load_strategy(n, cfg.model).reference)
    m = load_strategy(name, cfg.model).cost_model()
    if m is None:
        return None
    capacity = cluster.memory_per_rank if cluster else memory_here(1, memory_per_device)
    alone = replace(target, nodes=1, ranks_per_node=1, memory_per_rank=capacity)
    c = lay_out(m, shape, reference, beside(m), alone, global_batch)
    if cluster is None or step is None or not c.micro_batch or c.micro_batch == step.micro_batch:
        return c
    precision = cfg.training.precision
    counted = count_step_ops(cfg.model, cfg.training, c.micro_batch)
    alone = replace(alone, compute_bounds=device_time(counted.ops, cluster.device(precision)).shares)
    return lay_out(m, shape, on_device(cluster, counted, reference, precision), beside(m), alone, global_batch)
