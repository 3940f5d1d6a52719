"""At fixed depth, the widest model that fits under a strategy on the target: a search over one
factor on the hidden widths, reported as found or, where it stopped at its cap (or at a model it
could not build) with that model still fitting, as beyond what it reached."""

from __future__ import annotations

from dataclasses import replace

from analysis import projection as pj
from analysis.projection.advice import Candidate, Target
from analysis.projection.memory import StepMemory, peak_memory
from launchers.zoo import meta_sketch, model_shape
from strategies.experiment import ExperimentConfig

WIDTHS_CAP = 2**12  # the most the search scales the hidden widths by


def largest_widths(
    m: pj.StrategyModel, cfg: ExperimentConfig, c: Candidate, target: Target, beside: StepMemory
) -> tuple[list[int] | None, bool]:
    """At fixed depth, the widest model that fits under strategy ``m`` at the candidate's
    micro-batch: the hidden widths scaled by one factor (the first and last stay the task's), the
    model state of each exact (its shape on the meta device), the saved bytes per sample scaled
    with the hidden widths (estimated). None where the model has no hidden layer, nothing fits, or
    the model cannot be built on the meta device (pykan fits its splines while it builds: each
    try would build a real model, minutes at the widths searched). True beside it where the search
    stopped at its cap (WIDTHS_CAP times the widths) or at a model it could not build, with that
    model still fitting: the widest that fits is then beyond it, not found."""
    widths = list(cfg.model.widths)
    if len(widths) < 3 or not c.fits or meta_sketch(cfg.model) is None:
        return None, False

    def scaled(factor: float) -> list[int]:
        return [widths[0], *(max(1, round(w * factor)) for w in widths[1:-1]), widths[-1]]

    unbuilt: list[float] = []  # factors whose model could not be built: not a memory limit

    def fits(factor: float) -> bool:
        try:
            grown_model = cfg.model.model_copy(update={"widths": scaled(factor)}).model_dump()
            shape = replace(model_shape(grown_model), precision=cfg.training.precision)
        except Exception:
            unbuilt.append(factor)
            return False
        grown = StepMemory(beside.source, beside.fixed, beside.per_sample * sum(scaled(factor)) / sum(widths))
        return (
            peak_memory(
                m, shape, target.ranks, c.micro_batch, grown, target.offload_on_device, target.ranks_per_node
            ).total
            <= target.memory_per_rank
        )

    low, high = 1.0, 2.0
    while fits(high):
        if high >= WIDTHS_CAP:
            return scaled(high), True
        low, high = high, high * 2
    if unbuilt:
        return scaled(low), True
    for _ in range(12):  # to about 0.1% of the factor
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return scaled(low), bool(unbuilt)
