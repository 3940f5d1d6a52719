"""What a projection starts from: the model's parameter layout (ModelShape) and a measured
compute profile of one rank (ComputeProfile), read from 1-rank run records, a ``kanscale bench``
JSON, or the published study's 1-GPU run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from analysis.records.load import load_runs
from analysis.records.run_files import SUMMARY_FILE, read_summary
from analysis.records.schema import RunRecord

PAPER_BATCH = 512  # samples per GPU per step in the published study (reference/README.md)


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
    precision: str = "fp32"  # training.precision of the measured step (the model state follows it)
    # the step of one rank at the target's layout (a rehearsal's): its TP cut and its optimizer shard
    # are in it already; else a whole model's step, which the projection divides among those ranks
    per_rank: bool = False


@dataclass(frozen=True)
class ModelShape:
    """Element counts (fp32) of a model's parameters, from the zoo (launchers.zoo.model_shape)."""

    label: str
    tensors: tuple[int, ...]  # trainable elements per parameter tensor, in registration (forward) order
    units: tuple[int, ...]  # trainable elements per sharding unit: the root's own, then each KAN layer
    params: int  # every parameter element, frozen ones included (pykan's grids and masks)
    dtype_bytes: int = 4
    widths: tuple[int, ...] = ()  # the layer widths, input to output (what tensor parallelism exchanges)
    # training.precision it is trained in (fp32 | bf16 | fp16): what a backend that casts the
    # module (StrategyModel.casts_module) holds its parameters and gradients in
    precision: str = "fp32"

    @property
    def trainable(self) -> int:
        return sum(self.tensors)


def profile_from_record(record: RunRecord, run_dir: str) -> ComputeProfile:
    """A 1-rank run record: compute_s of the compute-only replica (optimizer included), data time,
    and the rest of its step as the strategy's bookkeeping."""
    t = record.timings
    if t is None or t.compute_s is None:
        raise ValueError(
            f"the 1-rank run {run_dir} timed no compute baseline (measurement.baseline: off); "
            "train it again with the baseline on"
        )
    return ComputeProfile(
        source=f"1-rank run {run_dir} ({record.topology.device_name})",
        samples=record.batch.micro_batch * record.batch.grad_accum,
        compute_s=t.compute_s,
        data_s=t.data_s,
        overhead_s=max(0.0, t.step_mean_s - t.data_s - t.compute_s),
        precision=record.precision.setting,
    )


def median_profile(profiles: Sequence[ComputeProfile], source: str) -> ComputeProfile:
    """Repeated runs of one point: the median of each time."""

    def med(field: str) -> float:
        return float(np.median([getattr(p, field) for p in profiles]))

    return replace(
        profiles[0],
        source=source,
        compute_s=med("compute_s"),
        data_s=med("data_s"),
        overhead_s=med("overhead_s"),
        optimizer_s=med("optimizer_s"),
    )


EXPERIMENT = ["study", "model_label", "task_label", "batch.micro_batch", "batch.grad_accum", "precision.setting"]


def profiles_from_runs(directory: str | Path) -> tuple[dict[str, ComputeProfile], dict[str, Any]]:
    """The finished 1-rank runs under ``directory`` (of one experiment): per strategy label the
    median profile of its runs, and under ``*`` (for strategies without a 1-rank run of their
    own) the one-process reference's (single's; ``strategy.reference`` in its records), else the
    median of all without any strategy's bookkeeping. Also the model
    config the runs trained."""
    runs, _ = load_runs(directory)
    ok = runs[(runs["status"] == "ok") & (runs["topology.world_size"] == 1)] if not runs.empty else runs
    if ok.empty:
        raise ValueError(
            f"{directory} holds no finished 1-rank run; train one (kanscale train CONFIG --out DIR) "
            "or give a kanscale bench JSON"
        )
    experiments = ok.groupby(EXPERIMENT, dropna=False).size()
    if len(experiments) > 1:
        names = "; ".join(" ".join(str(v) for v in key) for key in experiments.index)
        raise ValueError(
            f"{directory} holds 1-rank runs of {len(experiments)} experiments ({names}); point it at one "
            "run directory, or at a directory holding one experiment's runs"
        )
    records = {d: read_summary(Path(d) / SUMMARY_FILE) for d in ok["run_dir"]}
    first = next(iter(records.values()))
    where = f"1-rank runs under {directory} ({first.topology.device_name})"

    def median_of(run_dirs: Sequence[str], source: str) -> ComputeProfile:
        return median_profile([profile_from_record(records[d], d) for d in run_dirs], source)

    profiles = {
        str(label): median_of(list(group["run_dir"]), f"each strategy's own {where}")
        for label, group in ok.groupby("strategy_label")
    }
    reference = [d for d, record in records.items() if record.strategy.reference]
    fallback = (
        median_of(reference, f"{records[reference[0]].strategy.label}'s {where}")
        if reference
        else replace(median_profile(list(profiles.values()), f"all {where}"), overhead_s=0.0)
    )
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
    chosen = ok[0] if row is None else next((r for r, n in zip(ok, names, strict=True) if n == row), None)
    if chosen is None:
        raise ValueError(f"no finished row {row!r}; rows: {', '.join(names)}")
    fwd, bwd, step = (chosen[k]["median"] / 1e3 for k in ("forward_ms", "backward_ms", "step_ms"))
    env = doc["environment"]
    source = f"kanscale bench {chosen['workload']}/{chosen['impl']} ({env['gpu'] or env['cpu']}, {env['date'][:10]})"
    profile = ComputeProfile(
        source=source,
        samples=chosen["batch"],
        compute_s=fwd + bwd,
        optimizer_s=max(0.0, step - fwd - bwd),
        forward_fraction=fwd / (fwd + bwd),
        forward_source="measured",
    )
    return profile, chosen["workload"], chosen["impl"]


def paper_profile() -> tuple[ComputeProfile, dict[str, Any]]:
    """The published study's one-GPU run (strong scaling, 1 A100): its whole step, from its
    throughput at 512 samples per step; and the model it trained."""
    from analysis.report.paper import paper_results

    row = paper_results().set_index("run").loc["strong_scaling_n1g1"]
    profile = ComputeProfile(
        source=f"published 1-GPU run ({row['throughput_total_sps']} samples/s, A100)",
        samples=PAPER_BATCH,
        compute_s=PAPER_BATCH / float(row["throughput_total_sps"]),
    )
    model = {"family": "pykan", "widths": [2, int(row["hidden_width"]), 1], "grid": 10, "k": 3, "seed": 42}
    return profile, model
