"""Derived metrics. Computed here from the stored measurements, never stored as truth.

- speedup S(P) = throughput(P) / throughput(1): with a fixed amount of work, T(1) / T(P);
- parallel efficiency E(P) = S(P) / P;
- weak-scaling retention = per-rank throughput(P) / per-rank throughput(1);
- communication overhead in percent of the step;
- peak memory per rank (device memory on GPUs, resident memory on CPUs) and parameters per byte
  of it; activations per rank and their share of the counted step's tensor peak;
- achieved model FLOP/s per rank (the counted step's model FLOPs per sample x samples/s per rank)
  and, against a peak rate given to ``kanscale analyze``, model FLOPs utilisation (MFU).

The 1-rank baseline of a run is the 1-rank run of the same strategy on the same experiment: the
same study, strategy, model, task and per-rank batch, and everything else in its config.yaml but
the seed and the output directory (its repeat identity). A strategy that never ran on one rank (a
sweep that runs only the one-process reference at world size 1, as `make demo` does) is measured
against the `single` run of the same study, model, task and global batch instead: the same
training, done by one process. Column ``baseline`` says which ("own 1-rank", "single process").
Repeated runs of one point are summarised by their median, with the minimum and maximum beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

# What makes runs comparable across world sizes.
GROUP = ["study", "strategy_label", "model_label", "task_label", "batch.micro_batch", "batch.grad_accum"]
# What makes a strategy's run comparable with the one-process reference, when it has no 1-rank run.
SINGLE_GROUP = ["study", "model_label", "task_label", "batch.global_batch", "precision.setting", "compile.setting"]
# What makes runs repeats of one point.
POINT = [*GROUP, "topology.world_size", "topology.nodes"]


def derive(runs: pd.DataFrame, peak_flops_per_s: float | None = None) -> pd.DataFrame:
    """Finished runs with the derived columns added; ``peak_flops_per_s``: one rank's peak rate,
    which model FLOPs utilisation (``mfu``) is taken against (None: no MFU)."""
    if runs.empty:  # no records at all: nothing to derive (and no columns to select by)
        return runs.copy()
    ok = runs[runs["status"] == "ok"].copy()
    if ok.empty:
        return ok
    ok["study"] = ok["study"].fillna("(none)")
    ok["world_size"] = ok["topology.world_size"]
    ok["samples_per_s"] = ok["throughput.samples_per_s"]
    ok["samples_per_s_per_rank"] = ok["throughput.samples_per_s_per_rank"]
    one_rank = ok[ok["world_size"] == 1]
    # The same experiment, not only the same strategy and batch: a 1-rank run with another learning
    # rate or grid is another point, never this run's baseline (repeat_key: analysis/records/load.py).
    group = GROUP + (["repeat_key"] if "repeat_key" in ok else [])
    own = one_rank.groupby(group, dropna=False)["samples_per_s"].median().rename("own_baseline")
    single = (
        one_rank[one_rank["strategy.reference"].astype(bool)]
        .groupby(SINGLE_GROUP, dropna=False)["samples_per_s"]
        .median()
        .rename("single_baseline")
    )
    ok = ok.join(own, on=group).join(single, on=SINGLE_GROUP)
    ok["baseline"] = None
    ok.loc[ok["single_baseline"].notna(), "baseline"] = "single process"
    ok.loc[ok["own_baseline"].notna(), "baseline"] = "own 1-rank"
    ok["baseline_samples_per_s"] = ok["own_baseline"].fillna(ok["single_baseline"])
    ok = ok.drop(columns=["own_baseline", "single_baseline"])
    ok["speedup"] = ok["samples_per_s"] / ok["baseline_samples_per_s"]
    ok["efficiency"] = ok["speedup"] / ok["world_size"]
    ok["retention"] = ok["samples_per_s_per_rank"] / ok["baseline_samples_per_s"]
    ok["comm_overhead_pct"] = 100 * ok["comm_overhead"]
    for column, source in (
        ("step_ms", "timings.step_mean_s"),
        ("data_ms", "timings.data_s"),
        ("compute_ms", "timings.compute_s"),
        ("comm_ms", "timings.comm_exposed_s"),
        ("comm_check_ms", "comm.check.median_s"),
    ):
        ok[column] = 1e3 * optional(ok, source).astype(float)
    device_peak = optional(ok, "memory.peak_device_bytes")
    ok["peak_memory_bytes"] = device_peak.fillna(ok["memory.peak_rss_bytes"])
    ok["peak_memory_kind"] = np.where(device_peak.notna(), "device", "RSS")
    ok["params_per_byte"] = ok["model.params_total"] / ok["peak_memory_bytes"]
    ok["state_share_of_peak"] = ok["model_state_bytes"] / ok["peak_memory_bytes"]
    # The counted step's (schema v7): activations left for the backward, against the step's tensor peak.
    ok["activations_bytes"] = optional(ok, "memory.activations_after_forward_bytes").astype(float)
    ok["activations_share"] = ok["activations_bytes"] / optional(ok, "memory.step_peak.peak").astype(float)
    model_flops = optional(ok, "flops.model_per_sample").astype(float) * ok["samples_per_s_per_rank"]
    ok["model_gflops_per_rank"] = model_flops / 1e9
    ok["mfu"] = model_flops / peak_flops_per_s if peak_flops_per_s else np.nan
    # The spread of a run's rate over its timing windows (schema v3; a v2 record has none).
    for column, source in (
        ("samples_per_s_low", "throughput.samples_per_s_low"),
        ("samples_per_s_high", "throughput.samples_per_s_high"),
    ):
        ok[column] = optional(ok, source).fillna(ok["samples_per_s"])
    ok["outside_cores"] = optional(ok, "measurement.outside_load.cores_busy")
    ok["comm_agree"] = optional(ok, "comm.agree")
    ok["comm_trusted"] = optional(ok, "comm.trusted")
    # Ranks x (threads + DataLoader workers) per machine against its cores: at 1 or more, ranks
    # compete with the communication threads and everything else for cores; above 1, with each
    # other too.
    workers = optional(ok, "batch.loader_workers").fillna(0)
    ok["core_load"] = (
        ok["topology.procs_per_node"]
        * (optional(ok, "topology.threads_per_rank") + workers)
        / optional(ok, "environment.cpu_count")
    )
    return ok


def optional(runs: pd.DataFrame, column: str) -> pd.Series:
    """A column that records of some versions (or all of these runs) lack: NaN there."""
    return runs[column] if column in runs else pd.Series(np.nan, index=runs.index)


def summarize(derived: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per distinct ``keys``: each metric's median, min and max, and the repeat count."""
    grouped = derived.groupby(keys, dropna=False)[metrics]
    table = pd.concat(
        [grouped.median().add_suffix("_median"), grouped.min().add_suffix("_min"), grouped.max().add_suffix("_max")],
        axis=1,
    )
    table["repeats"] = derived.groupby(keys, dropna=False).size()
    return table.reset_index()


def with_spread(
    summary: pd.DataFrame, metric: str, fmt: Callable[[float], str], window: tuple[str, str] | None = None
) -> pd.Series:
    """``median [min-max]`` for repeats; for one run ``median`` alone, or, where the metric has a
    within-run spread (``window``: the columns of its slowest and fastest timing window, which
    ``summary`` must hold too), ``median [slowest-fastest]``; blank where undefined."""

    def cell(row: pd.Series) -> str:
        median = row[f"{metric}_median"]
        if pd.isna(median):
            return ""
        text = fmt(median)
        if row["repeats"] > 1:
            text += f" [{fmt(row[f'{metric}_min'])}-{fmt(row[f'{metric}_max'])}]"
        elif window is not None and row[f"{window[0]}_min"] < row[f"{window[1]}_max"]:
            text += f" [{fmt(row[f'{window[0]}_min'])}-{fmt(row[f'{window[1]}_max'])}]"
        return text

    return summary.apply(cell, axis=1) if not summary.empty else pd.Series(dtype=str)
