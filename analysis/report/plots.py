"""Plots (PNG) that read on their own: a title saying what and on which hardware, labelled axes
with units, one colour per strategy throughout.

Every point drawn is a measurement: a strategy's line holds only the world sizes it ran. Where
its speedup is measured against another run (the one-process ``single`` run, derive's
``baseline`` "single process"), that run is drawn as its own marker, apart from every line.
Model state is drawn beside the peak memory it is part of, with its share in words, so a saving
of kilobytes is not read as a saving of the hundreds of megabytes a process holds.

Each plot function builds and returns a Figure (which tests inspect); ``study_plots`` saves them.
Figures are made without pyplot: no display, and no global registry holding every figure built.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.report.derive import summarize
from analysis.report.tables import hardware
from kanscale.writes import atomic_write_bytes

# The marker for a baseline that is another run, not a point of the strategy's line.
BASELINE_LABEL = "1-process baseline (another run: single)"
STATE_PARTS = [
    ("memory.model_state.params", "parameters"),
    ("memory.model_state.grads", "gradients"),
    ("memory.model_state.optimizer", "optimizer state"),
    ("memory.model_state.master_params", "fp32 master copy"),
]


def colours(strategies: list[str]) -> dict[str, tuple]:
    palette = matplotlib.colormaps["tab10"]
    return {s: palette(i % 10) for i, s in enumerate(sorted(strategies))}


def figure(title: str, runs: pd.DataFrame) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.5, 4.6), dpi=110)
    ax = fig.subplots()
    fig.suptitle(title, fontsize=12, fontweight="bold")
    ax.set_title(hardware(runs), fontsize=8, color="0.35")
    ax.grid(True, alpha=0.3)
    return fig, ax


def share_text(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole`` with two significant digits, however small: 4 KiB of
    350 MiB reads ``0.0011%``, not ``0.0%``."""
    if not whole or not np.isfinite(part) or not np.isfinite(whole):
        return "n/a"
    share = 100 * part / whole
    if share <= 0:
        return "0%"
    return f"{share:.{max(0, 1 - math.floor(math.log10(share)))}f}%"


def save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic_write_bytes(path, png.getvalue())
    return path


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit that keeps the largest value of a plot between 1 and 1024."""
    for power, name in enumerate(("B", "KiB", "MiB", "GiB")):
        if largest < 1024 ** (power + 1):
            return name, 1024.0**power
    return "TiB", 1024.0**4


def main_model(runs: pd.DataFrame) -> pd.DataFrame:
    """Scaling curves are drawn for one model: the one most runs used."""
    model = runs["model_label"].value_counts().index[0]
    return runs[runs["model_label"] == model]


def scaling_plot(
    runs: pd.DataFrame, metric: str, ylabel: str, title: str, ideal: Callable | None = None, percent: bool = False
) -> Figure:
    """One line per strategy over the world sizes it ran. For a metric relative to 1 rank (``ideal``
    given) whose baseline is the one-process run for some strategy, that run is a hollow star at
    (1, ideal(1)), in the legend as another run."""
    runs = main_model(runs)
    fig, ax = figure(f"{title}: {runs['model_label'].iloc[0]}", runs)
    summary = summarize(runs, ["strategy_label", "world_size"], [metric])
    palette = colours(list(summary["strategy_label"].unique()))
    scale = 100 if percent else 1
    for label, rows in summary.groupby("strategy_label"):
        strategy = str(label)
        rows = rows.dropna(subset=[f"{metric}_median"]).sort_values("world_size")
        if rows.empty:
            continue
        ax.plot(
            rows["world_size"], rows[f"{metric}_median"] * scale, marker="o", label=strategy, color=palette[strategy]
        )
        if (rows["repeats"] > 1).any():
            ax.fill_between(
                rows["world_size"],
                rows[f"{metric}_min"] * scale,
                rows[f"{metric}_max"] * scale,
                color=palette[strategy],
                alpha=0.15,
            )
    sizes = sorted(summary["world_size"].unique())
    if ideal is not None and (runs["baseline"] == "single process").any():
        ax.plot(
            [1],
            [ideal(1)],
            linestyle="none",
            marker="*",
            markersize=14,
            markerfacecolor="none",
            markeredgecolor="black",
            markeredgewidth=1.2,
            label=BASELINE_LABEL,
            zorder=5,
        )
        sizes = sorted({1, *sizes})
    if ideal is not None:
        ax.plot(sizes, [ideal(p) for p in sizes], "k--", linewidth=1, label="ideal")
    ax.set_xticks(sizes)
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return fig


def speedup_plot(runs: pd.DataFrame) -> Figure:
    return scaling_plot(runs, "speedup", "speedup over 1 rank", "Strong scaling: speedup", ideal=lambda p: p)


def efficiency_plot(runs: pd.DataFrame) -> Figure:
    return scaling_plot(
        runs, "efficiency", "parallel efficiency (%)", "Parallel efficiency", ideal=lambda p: 100, percent=True
    )


def weak_throughput_plot(runs: pd.DataFrame) -> Figure:
    return scaling_plot(runs, "samples_per_s_per_rank", "samples/s per rank", "Weak scaling: throughput per rank")


def bar_plot(
    runs: pd.DataFrame,
    metric: str,
    ylabel: str,
    title: str,
    scale: float = 1.0,
    window_spread: tuple[str, str] | None = None,
) -> Figure:
    """One bar per strategy, grouped by model and nodes x ranks (a median over different models
    would describe none of them); a group holds only the strategies that ran there, so a lone
    1-rank reference does not leave a row of empty slots. Error bars: the min-max of repeated
    runs, or for a point run once the ``window_spread`` columns (its slowest and fastest window)."""
    extra = list(window_spread or ())
    summary = summarize(
        runs, ["strategy_label", "model.params_trainable", "model_label", "topology_label"], [metric, *extra]
    ).dropna(subset=[f"{metric}_median"])
    palette = colours(list(summary["strategy_label"].unique()))
    fig, ax = figure(title, runs)
    several_models = summary["model_label"].nunique() > 1
    ticks, tick_labels, start = [], [], 0.0
    for (_, model, topology), rows in summary.groupby(
        ["model.params_trainable", "model_label", "topology_label"], sort=True
    ):
        rows = rows.sort_values("strategy_label")
        x = start + np.arange(len(rows))
        for xi, (_, row) in zip(x, rows.iterrows(), strict=True):
            strategy, median = row["strategy_label"], row[f"{metric}_median"]
            low, high = (
                (row[f"{metric}_min"], row[f"{metric}_max"])
                if row["repeats"] > 1 or not extra
                else (row[f"{extra[0]}_min"], row[f"{extra[1]}_max"])
            )
            ax.bar(
                xi,
                median * scale,
                0.8,
                color=palette[strategy],
                label=strategy if strategy not in ax.get_legend_handles_labels()[1] else None,
            )
            if high > low:
                ax.errorbar(
                    xi,
                    median * scale,
                    yerr=[[(median - low) * scale], [(high - median) * scale]],
                    color="0.2",
                    capsize=3,
                    linewidth=1,
                )
        ticks.append(x.mean())
        tick_labels.append(f"{topology} (nodes x ranks)" + (f"\n{model}" if several_models else ""))
        start += len(rows) + 1  # one empty slot between groups
    ax.set_xticks(ticks, tick_labels, fontsize=8 if several_models else None)
    ax.set_ylabel(ylabel)
    if extra:
        ax.set_xlabel("error bars: min-max over repeats, or over a single run's timing windows", fontsize=8)
    ax.legend(fontsize=8, ncol=2)
    return fig


def comm_overhead_plot(runs: pd.DataFrame) -> Figure:
    return bar_plot(runs, "comm_overhead", "exposed communication (% of step)", "Communication overhead", scale=100)


def throughput_plot(runs: pd.DataFrame) -> Figure:
    return bar_plot(
        runs,
        "samples_per_s",
        "samples/s (all ranks)",
        "Throughput",
        window_spread=("samples_per_s_low", "samples_per_s_high"),
    )


def peak_kind(runs: pd.DataFrame) -> str:
    return "device memory" if runs["peak_memory_kind"].iloc[0] == "device" else "resident memory (RSS)"


def memory_vs_size_plot(runs: pd.DataFrame) -> Figure:
    """Model-state bytes (left) and peak memory (right) per rank against trainable parameters,
    one line per strategy, on one shared scale so the gap between the two shows; a box lists each
    strategy's model state as a share of its peak, at its largest model."""
    summary = summarize(runs, ["strategy_label", "model.params_trainable"], ["peak_memory_bytes", "model_state_bytes"])
    palette = colours(list(summary["strategy_label"].unique()))
    kind = peak_kind(runs)
    unit, divisor = byte_unit(
        float(np.nanmax(summary[["peak_memory_bytes_median", "model_state_bytes_median"]].to_numpy()))
    )
    fig = Figure(figsize=(11, 4.6), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    fig.suptitle(f"Memory per rank vs model size ({hardware(runs)})", fontsize=12, fontweight="bold")
    panels = [
        ("model_state_bytes", "model state (params, grads, optimizer, master)"),
        ("peak_memory_bytes", f"peak {kind}"),
    ]
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for label, rows in summary.groupby("strategy_label"):
            strategy = str(label)
            rows = rows.sort_values("model.params_trainable")
            ax.plot(
                rows["model.params_trainable"],
                rows[f"{metric}_median"] / divisor,
                marker="o",
                color=palette[strategy],
                label=strategy,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("trainable parameters")
        ax.grid(True, alpha=0.3, which="both")
    at_largest = (
        summary.sort_values("model.params_trainable").groupby("strategy_label").tail(1).sort_values("strategy_label")
    )
    shares = [
        f"{row['strategy_label']}: {share_text(row['model_state_bytes_median'], row['peak_memory_bytes_median'])}"
        for _, row in at_largest.iterrows()
    ]
    axes[1].text(
        0.98,
        0.03,
        "model state / peak, largest model:\n" + "\n".join(shares),
        transform=axes[1].transAxes,
        ha="right",
        va="bottom",
        fontsize=7,
        bbox={"facecolor": "white", "edgecolor": "0.8"},
    )
    axes[0].set_ylabel(f"{unit} per rank (both panels)")
    axes[1].legend(fontsize=8)
    return fig


def state_stack_plot(runs: pd.DataFrame) -> Figure:
    """For the largest model at its largest world size, per strategy: model-state bytes per rank
    stacked by kind (left), and the peak memory per rank that holds them (right), each bar labelled
    with the model state's share of it (``model state = 0.0011% of peak RSS``)."""
    largest = runs[runs["model.params_trainable"] == runs["model.params_trainable"].max()]
    largest = largest[largest["world_size"] == largest["world_size"].max()]
    summary = summarize(
        largest, ["strategy_label"], [p for p, _ in STATE_PARTS] + ["model_state_bytes", "peak_memory_bytes"]
    )
    summary = summary.sort_values("strategy_label")
    fig = Figure(figsize=(12, 4.8), dpi=110)
    ax, peak_ax = fig.subplots(1, 2)
    fig.suptitle(
        f"Model state per rank and the peak memory it is part of: {largest['model_label'].iloc[0]}, "
        f"{largest['world_size'].iloc[0]} ranks",
        fontsize=12,
        fontweight="bold",
    )
    parts = summary[[f"{column}_median" for column, _ in STATE_PARTS]].to_numpy(dtype=float)
    unit, divisor = byte_unit(float(np.nansum(parts, axis=1).max()))
    bottom = np.zeros(len(summary))
    for column, label in STATE_PARTS:
        values = np.nan_to_num(summary[f"{column}_median"].to_numpy(dtype=float)) / divisor
        ax.bar(summary["strategy_label"], values, bottom=bottom, label=label)
        bottom += values
    ax.set_title(f"model state by kind ({hardware(largest)})", fontsize=8, color="0.35")
    ax.set_ylabel(f"{unit} per rank")
    ax.legend(fontsize=8)
    kind = "peak RSS" if largest["peak_memory_kind"].iloc[0] == "RSS" else "peak device memory"
    peak_panel(peak_ax, summary, kind)
    for axis in (ax, peak_ax):
        axis.grid(True, alpha=0.3, axis="y")
        for label in axis.get_xticklabels():
            label.set(rotation=30, ha="right", rotation_mode="anchor")
    return fig


def peak_panel(ax: Axes, summary: pd.DataFrame, kind: str) -> None:
    """Peak memory per strategy as bars, the model state drawn on the same scale inside them, and
    each bar labelled with the model state's share of it."""
    peaks = summary["peak_memory_bytes_median"].to_numpy(dtype=float)
    ax.set_title(f"{kind} per rank, with the model state's share", fontsize=8, color="0.35")
    if not np.isfinite(peaks).any():  # records without memory measurements
        ax.text(0.5, 0.5, f"no {kind} recorded", transform=ax.transAxes, ha="center")
        return
    unit, divisor = byte_unit(float(np.nanmax(peaks)))
    ax.bar(summary["strategy_label"], peaks / divisor, color="0.75", label=kind)
    ax.bar(
        summary["strategy_label"],
        summary["model_state_bytes_median"].to_numpy(dtype=float) / divisor,
        color="tab:blue",
        label="model state (same scale)",
    )
    for x, (state, peak) in enumerate(zip(summary["model_state_bytes_median"], peaks, strict=True)):
        # upright inside the bar: nine strategies' labels side by side stay apart
        ax.text(
            x,
            np.nan_to_num(peak) / divisor / 2,
            f"model state = {share_text(state, peak)} of {kind}",
            rotation=90,
            ha="center",
            va="center",
            fontsize=7,
        )
    ax.set_ylabel(f"{unit} per rank")
    ax.set_ylim(0, 1.25 * np.nanmax(peaks) / divisor)  # headroom: the legend above the bars
    ax.legend(fontsize=8, loc="upper right")


# Which plots each study gets (others get DEFAULT_PLOTS); name -> function.
PLOTS: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "speedup": speedup_plot,
    "efficiency": efficiency_plot,
    "weak_throughput": weak_throughput_plot,
    "comm_overhead": comm_overhead_plot,
    "throughput": throughput_plot,
    "memory_vs_size": memory_vs_size_plot,
    "model_state": state_stack_plot,
}
STUDY_PLOTS = {
    "strong": ["speedup", "efficiency", "comm_overhead"],
    "weak": ["weak_throughput", "efficiency"],
    "comm": ["comm_overhead"],
    "model_size": ["throughput", "memory_vs_size"],
    "memory": ["memory_vs_size", "model_state"],
}
DEFAULT_PLOTS = ["throughput", "comm_overhead", "model_state"]


def study_plots(runs: pd.DataFrame, study: str, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    names = STUDY_PLOTS.get(study, DEFAULT_PLOTS)
    if study not in STUDY_PLOTS and runs.loc[runs["world_size"] > 1, "speedup"].notna().any():
        names = ["speedup", *names]
    return [save(PLOTS[name](runs), directory / f"{study}_{name}.png") for name in names]
