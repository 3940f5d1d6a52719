"""What activation checkpointing would change in an answer. For an experiment that does not
checkpoint, each strategy whose per-rank batch needs more than one micro-batch (or fits in none)
is laid out again with the model's units checkpointed (``training.activation_checkpointing:
layers``): its activations per sample counted as the probe counts them, checkpointed. Where the
batch then fits in fewer micro-batches, or fits at all, the answer says so, with the estimated
cost of the recomputation: the step's kernels counted with and without it (the larger of the
FLOPs' and the bytes' ratio: a KAN's recomputed bases are elementwise work, which FLOPs miss)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from analysis.projection.advice import Candidate
from kanscale.errors import ConfigError
from launchers.recommend.probe import device_step_memory
from launchers.recommend.step_ops import count_step_ops
from strategies.experiment import ExperimentConfig


def checkpointed(cfg: ExperimentConfig) -> ExperimentConfig:
    """The experiment with its layers checkpointed."""
    training = cfg.training.model_copy(update={"activation_checkpointing": "layers"})
    return cfg.model_copy(update={"training": training})


def recompute_cost(cfg: ExperimentConfig, micro_batch: int) -> float:
    """The step's kernels with the layers checkpointed over without (estimated)."""
    plain, layers = (count_step_ops(c.model, c.training, micro_batch) for c in (cfg, checkpointed(cfg)))
    return max(
        sum(o.flops for o in layers.ops) / max(1.0, sum(o.flops for o in plain.ops)),
        sum(o.bytes for o in layers.ops) / max(1.0, sum(o.bytes for o in plain.ops)),
    )


def checkpointing_lines(
    cfg: ExperimentConfig,
    micro_batch: int,
    candidates: Iterable[Candidate],
    lay_out_again: Callable[[Candidate, float], Candidate],
) -> list[str]:
    """One line per strategy that checkpointing would let run its batch in fewer micro-batches;
    ``lay_out_again``: the candidate laid out again with this many activation bytes per sample."""
    needy = [c for c in candidates if not c.fits or c.grad_accum > 1]
    if cfg.training.activation_checkpointing != "none" or not needy:
        return []
    try:
        per_sample = device_step_memory(checkpointed(cfg), micro_batch).per_sample
    except ConfigError:  # a model without units to checkpoint: nothing to suggest
        return []
    fix = "--set training.activation_checkpointing=layers"
    if cfg.training.compile != "none":  # refused together (strategies/sections.py): the layers run eager
        fix += " --set training.compile=none"
    lines, cost = [], None
    for c in needy:
        again = lay_out_again(c, per_sample)
        if not again.fits or (c.fits and again.grad_accum >= c.grad_accum):
            continue
        cost = cost if cost is not None else recompute_cost(cfg, micro_batch)
        before = f"{c.grad_accum} micro-batches of {c.micro_batch}" if c.fits else "no micro-batch that fits"
        lines.append(
            f"{c.strategy}: with {fix} its batch fits in "
            f"{again.grad_accum} micro-batch(es) of {again.micro_batch} samples per rank (without: {before}); "
            f"the recomputation costs about x{cost:.2f} a micro-batch's compute (estimated: the step's kernels "
            "counted with and without it)"
        )
    return lines
