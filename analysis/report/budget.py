"""The memory budget table: for a budget of memory per rank, the largest micro-batch each strategy
fits without and with activation checkpointing, and what checkpointing costs in samples/s.

From runs of one model at two micro-batches or more (the ``activation_memory`` study): the counted
step's tensor peak (``memory.step_peak.peak``, schema v7) grows with the micro-batch by what each
sample keeps and makes, above what the step holds whatever the batch (model state, fixed
temporaries). A least-squares line through the measured points, solved for the budget, gives the
largest micro-batch: a projection beyond the batches measured, labelled so. The tensor peak is
what an allocator must hold, before its caching and fragmentation and without the process's own
overhead (a CUDA context, the interpreter), so a real budget leaves room for those."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.report.format import human_bytes
from analysis.report.tables import Table, count, fixed

GiB = 2**30
KEYS = ["study", "model_label", "task_label", "strategy.label", "precision.setting"]
PEAK = "memory.step_peak.peak"
MODE = "memory.activation_checkpointing"


def fitted_line(points: pd.DataFrame) -> tuple[float, float] | None:
    """Bytes at the peak as ``fixed + per_sample x micro-batch``, through the medians of each
    measured micro-batch; None with fewer than two."""
    by_batch = points.groupby("batch.micro_batch")[PEAK].median()
    if len(by_batch) < 2:
        return None
    per_sample, fixed_bytes = np.polyfit(by_batch.index.to_numpy(float), by_batch.to_numpy(float), 1)
    return float(fixed_bytes), float(per_sample)


def largest_batch(line: tuple[float, float] | None, budget: float) -> str:
    if line is None:
        return "one micro-batch measured: no fit"
    fixed_bytes, per_sample = line
    if fixed_bytes >= budget:
        return f"none: {human_bytes(fixed_bytes)} before any sample"
    if per_sample <= 0:
        return "no growth with the batch measured"
    # The fit's rounding (a few ULPs, which vary with the LAPACK path taken) must not cost a
    # sample where the budget holds a whole number of them exactly.
    return count(math.floor(round((budget - fixed_bytes) / per_sample, 6)))


def throughput_cost(without: pd.DataFrame, with_: pd.DataFrame) -> float:
    """Samples/s with checkpointing over without, at the largest micro-batch both ran."""
    shared = set(without["batch.micro_batch"]) & set(with_["batch.micro_batch"])
    if not shared:
        return math.nan
    at = max(shared)
    rate = {
        name: runs[runs["batch.micro_batch"] == at]["samples_per_s"].median()
        for name, runs in (("without", without), ("with", with_))
    }
    return rate["with"] / rate["without"]


def budget_table(derived: pd.DataFrame, budget: float) -> Table | None:
    """The table for ``budget`` bytes per rank, over the runs that ran a model both without and
    with checkpointing; None where none did."""
    if PEAK not in derived or MODE not in derived:
        return None
    runs = derived.dropna(subset=[PEAK, MODE])
    rows = []
    for key, group in runs.groupby(KEYS, dropna=False):
        modes = {mode: group[group[MODE] == mode] for mode in ("none", "layers")}
        if modes["none"].empty or modes["layers"].empty:
            continue
        lines = {mode: fitted_line(points) for mode, points in modes.items()}
        per_sample = {mode: line[1] if line else math.nan for mode, line in lines.items()}
        rows.append(
            {
                **dict(zip(KEYS, key, strict=True)),
                "bytes_per_sample": per_sample["none"],
                "bytes_per_sample_checkpointed": per_sample["layers"],
                "largest_micro_batch": largest_batch(lines["none"], budget),
                "largest_micro_batch_checkpointed": largest_batch(lines["layers"], budget),
                "checkpointed_throughput": throughput_cost(modes["none"], modes["layers"]),
                "micro_batches": "-".join(str(b) for b in sorted(set(group["batch.micro_batch"]))),
            }
        )
    if not rows:
        return None
    data = pd.DataFrame(rows).sort_values(["model_label", "strategy.label"])
    text = pd.DataFrame(
        {
            "model": data["model_label"],
            "strategy": data["strategy.label"],
            "bytes / sample, without / with checkpointing": [
                f"{human_bytes(a)} / {human_bytes(b)}"
                for a, b in zip(data["bytes_per_sample"], data["bytes_per_sample_checkpointed"], strict=True)
            ],
            f"largest micro-batch in {human_bytes(budget)} (projected), without": data["largest_micro_batch"],
            "with checkpointing": data["largest_micro_batch_checkpointed"],
            "samples/s with / without": data["checkpointed_throughput"].map(
                lambda v: "" if pd.isna(v) else f"{fixed(2)(v)}x"
            ),
            "micro-batches measured": data["micro_batches"],
        }
    )
    caption = (
        f"Memory budget: for {human_bytes(budget)} of memory per rank (`kanscale analyze --memory-budget GIB`), "
        "the largest micro-batch each strategy fits without and with activation checkpointing, projected by "
        "a line through the counted step's tensor peak at the micro-batches measured (model state and fixed "
        "temporaries, plus bytes per sample); before an allocator's caching and the process's own overhead. "
        "Samples/s with / without: at the largest micro-batch both ran (this machine's timing noise applies)."
    )
    return Table("memory_budget", caption, data.reset_index(drop=True), text.reset_index(drop=True))
