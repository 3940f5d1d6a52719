"""What ``kanscale recommend`` knows of each strategy on a GPU cluster before it predicts: each
candidate's own step rehearsed at the target's world size and mesh, as its rank 0, on the fake
process group (``kanscale rehearse``; strategies/rehearsal/), in place of the 1-rank probes that
measure this machine. A rehearsal times nothing: on a GPU a rank's compute is its kernels
(the model's and the backend's own), each costed on the device (analysis/projection/device_time.py),
and nothing timed on this CPU is carried over. From each rehearsal: those kernels, the optimizer
state the backend keeps beyond the per-parameter formula, and a refusal where the backend or the
suite would refuse the layout (a mesh that does not divide, a batch the ranks cannot share).

A rehearsal holds one rank's tensors for real here (DeepSpeed refuses fake ones), so a strategy
whose rank would hold more than REHEARSAL_LIMIT is derived instead: the model's own kernels,
counted on fake tensors, and the model state from the strategy's formulas (analysis/projection/
strategy_model.py, checked against real runs' records in tests/test_projection_memory.py), each
labelled so."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from analysis import projection as pj
from analysis.projection.device_time import StepOps
from analysis.projection.memory import StepMemory, peak_memory
from analysis.report.format import human_bytes
from kanscale import log
from kanscale.errors import ConfigError
from launchers.recommend.probe import Probe, device_step_memory
from launchers.recommend.step_ops import count_step_ops
from launchers.rehearse import RehearsalRequest, rehearsal_children, rehearse_in_child
from strategies.experiment import ExperimentConfig
from strategies.rehearsal.result import Rehearsal

logger = log.get(__name__)

# the most a rehearsed rank may hold here (the model as built, its state, what it gathers, its batch's tensors)
REHEARSAL_LIMIT = 2**30


@dataclass(frozen=True)
class Rehearsed:
    """Per strategy label: its rank's step as rehearsed (or derived), where it came from, and the
    optimizer bytes its backend keeps beyond the formula; per preset name, the layouts refused."""

    steps: dict[str, StepOps] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)


def batch_settings(global_batch: int) -> list[str]:
    """The overrides that make a rehearsal's step the target's: the global batch in one micro-batch
    per rank (the layout's search may accumulate; compute then scales with the samples)."""
    return [f"training.global_batch={global_batch}", "training.micro_batch=null", "training.grad_accum=1"]


def rehearse_candidates(
    config: str,
    overrides: list[str],
    models: dict[str, pj.StrategyModel],
    shape: pj.ModelShape,
    nodes: int,
    per_node: int,
    global_batch: int,
    data: StepMemory,
) -> Rehearsed:
    """Each candidate (preset name -> its model) rehearsed at ``nodes`` x ``per_node`` ranks, or
    derived where its rank would hold more than REHEARSAL_LIMIT here (``data``: what a rank holds
    beside the model state, per sample)."""
    ranks = nodes * per_node
    out = Rehearsed()
    with tempfile.TemporaryDirectory(prefix="kanscale-recommend-") as scratch, rehearsal_children():
        for i, (name, m) in enumerate(models.items(), 1):
            micro_batch = global_batch / (ranks // m.tp_ranks(ranks))
            # every rank builds the whole model (fp32) before its backend shards or casts it
            held = peak_memory(m, shape, ranks, micro_batch, data, True, per_node).total + 4 * shape.params
            if held > REHEARSAL_LIMIT:
                out.sources[m.label] = (
                    f"derived, not rehearsed: a rank would hold {human_bytes(held)} here (more than "
                    f"{human_bytes(REHEARSAL_LIMIT)}); the model's kernels without the backend's, its state by formula"
                )
                continue
            started = time.perf_counter()
            logger.info(f"[recommend] rehearsing {name} at {ranks} ranks ({i}/{len(models)}) ...")
            request = RehearsalRequest(
                config, [*overrides, *batch_settings(global_batch)], name, nodes, per_node, 0, None
            )
            result = rehearse_in_child(request, name, Path(scratch) / f"{i}.json")
            if not isinstance(result, Rehearsal):
                out.refusals[name] = result.reason
                continue
            formula = pj.model_state(m, shape, ranks, per_node)["optimizer"]
            out.steps[m.label] = result.step_ops()
            out.counters[m.label] = max(0.0, result.model_state.optimizer - formula)
            out.sources[m.label] = (
                f"rehearsed at {ranks} rank{'s' if ranks > 1 else ''} as rank 0 "
                f"in {time.perf_counter() - started:.1f} s: "
                f"{result.kernels} kernels per step of {result.micro_batch} samples"
            )
    return out


def rehearsal_probe(rehearsed: Rehearsed, reference: StepOps, data: StepMemory, runs: Path) -> Probe:
    """What the prediction starts from on a GPU target: nothing timed here (every profile's times
    are zero; the device's cost of each step's kernels replaces them), the rank's memory beside the
    model state as counted here (``data``), and each rehearsed step's kernels."""
    nothing = pj.ComputeProfile("rehearsed: nothing timed on this CPU", samples=reference.micro_batch, compute_s=0.0)
    labels = ["*", *rehearsed.sources]
    return Probe(
        compute=dict.fromkeys(labels, nothing),
        beside=dict.fromkeys(labels, data),
        optimizer_bytes={},
        device=data,
        micro_batch=reference.micro_batch,
        runs=runs,
        steps={"*": reference, **rehearsed.steps},
        counters=rehearsed.counters,
        sources=rehearsed.sources,
    )


def rehearsed_probe(
    config: str,
    overrides: list[str],
    cfg: ExperimentConfig,
    shape: pj.ModelShape,
    models: dict[str, pj.StrategyModel],
    layout: tuple[int, int],
    global_batch: int,
    micro_batch: int,
    out: Path,
) -> tuple[Probe, dict[str, pj.StrategyModel], dict[str, str]]:
    """Every candidate rehearsed on ``layout`` (nodes, ranks per node): what the prediction starts
    from, the candidates whose layout no rehearsal refused, and each refusal (preset name -> why);
    a ConfigError naming each where every one is refused. ``micro_batch``: the samples the bytes
    autograd saves per sample are counted at."""
    nodes, per_node = layout
    data = device_step_memory(cfg, micro_batch)
    rehearsed = rehearse_candidates(config, overrides, models, shape, nodes, per_node, global_batch, data)
    kept = {name: m for name, m in models.items() if name not in rehearsed.refusals}
    if not kept:
        raise ConfigError(
            f"every candidate's rehearsal at {nodes * per_node} ranks refused the layout: "
            + "; ".join(f"{name}: {why}" for name, why in rehearsed.refusals.items())
        )
    step = count_step_ops(cfg.model, cfg.training, max(1, global_batch // (nodes * per_node)))
    return rehearsal_probe(rehearsed, step, data, out), kept, rehearsed.refusals
