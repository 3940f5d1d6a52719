"""Plots (PNG) that read on their own: a title saying what and on which hardware, labelled axes
with units, one colour per strategy throughout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.derive import summarize  # noqa: E402
from analysis.tables import hardware  # noqa: E402

STATE_PARTS = [("memory.model_state.params", "parameters"), ("memory.model_state.grads", "gradients"),
               ("memory.model_state.optimizer", "optimizer state"), ("memory.model_state.master_params", "fp32 master copy")]


def colours(strategies: list[str]) -> dict[str, tuple]:
    palette = plt.get_cmap("tab10")
    return {s: palette(i % 10) for i, s in enumerate(sorted(strategies))}


def figure(title: str, runs: pd.DataFrame) -> tuple[plt.Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    ax.set_title(hardware(runs), fontsize=8, color="0.35")
    ax.grid(True, alpha=0.3)
    return fig, ax


def save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
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


def scaling_plot(runs: pd.DataFrame, metric: str, ylabel: str, title: str, path: Path, ideal: Callable | None = None,
                 percent: bool = False) -> Path:
    """One line per strategy over world size. For a metric relative to 1 rank (``ideal`` given), a
    strategy measured against the one-process run starts from that run's point, ideal(1), so its
    line reads like the others'."""
    runs = main_model(runs)
    fig, ax = figure(f"{title}: {runs['model_label'].iloc[0]}", runs)
    summary = summarize(runs, ["strategy_label", "world_size"], [metric])
    palette = colours(list(summary["strategy_label"].unique()))
    for strategy, rows in summary.groupby("strategy_label"):
        rows = rows.dropna(subset=[f"{metric}_median"]).sort_values("world_size")
        if rows.empty:
            continue
        scale = 100 if percent else 1
        if ideal is not None and rows["world_size"].min() > 1:
            start = {"world_size": 1, "repeats": 1, **{f"{metric}_{s}": ideal(1) / scale for s in ("median", "min", "max")}}
            rows = pd.concat([pd.DataFrame([start]), rows], ignore_index=True)
        y = rows[f"{metric}_median"] * scale
        ax.plot(rows["world_size"], y, marker="o", label=strategy, color=palette[strategy])
        if (rows["repeats"] > 1).any():
            ax.fill_between(rows["world_size"], rows[f"{metric}_min"] * scale, rows[f"{metric}_max"] * scale,
                            color=palette[strategy], alpha=0.15)
    sizes = sorted(summary["world_size"].unique())
    if ideal is not None:
        ax.plot(sizes, [ideal(p) for p in sizes], "k--", linewidth=1, label="ideal")
    ax.set_xticks(sizes)
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return save(fig, path)


def speedup_plot(runs: pd.DataFrame, path: Path) -> Path:
    return scaling_plot(runs, "speedup", "speedup over 1 rank", "Strong scaling: speedup", path, ideal=lambda p: p)


def efficiency_plot(runs: pd.DataFrame, path: Path) -> Path:
    return scaling_plot(runs, "efficiency", "parallel efficiency (%)", "Parallel efficiency", path,
                        ideal=lambda p: 100, percent=True)


def weak_throughput_plot(runs: pd.DataFrame, path: Path) -> Path:
    return scaling_plot(runs, "samples_per_s_per_rank", "samples/s per rank", "Weak scaling: throughput per rank", path)


def bar_plot(runs: pd.DataFrame, metric: str, ylabel: str, title: str, path: Path, scale: float = 1.0) -> Path:
    """One bar per strategy, grouped by nodes x ranks; a group holds only the strategies that ran
    at that topology, so a lone 1-rank reference does not leave a row of empty slots."""
    summary = summarize(runs, ["strategy_label", "topology_label"], [metric]).dropna(subset=[f"{metric}_median"])
    palette = colours(list(summary["strategy_label"].unique()))
    fig, ax = figure(title, runs)
    ticks, tick_labels, start = [], [], 0.0
    for topology, rows in summary.groupby("topology_label", sort=True):
        rows = rows.sort_values("strategy_label")
        x = start + np.arange(len(rows))
        for xi, (_, row) in zip(x, rows.iterrows()):
            strategy = row["strategy_label"]
            ax.bar(xi, row[f"{metric}_median"] * scale, 0.8, color=palette[strategy],
                   label=strategy if strategy not in ax.get_legend_handles_labels()[1] else None)
        ticks.append(x.mean())
        tick_labels.append(f"{topology} (nodes x ranks)")
        start += len(rows) + 1  # one empty slot between groups
    ax.set_xticks(ticks, tick_labels)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, ncol=2)
    return save(fig, path)


def comm_overhead_plot(runs: pd.DataFrame, path: Path) -> Path:
    return bar_plot(runs, "comm_overhead", "exposed communication (% of step)", "Communication overhead", path, scale=100)


def throughput_plot(runs: pd.DataFrame, path: Path) -> Path:
    return bar_plot(runs, "samples_per_s", "samples/s (all ranks)", "Throughput", path)


def memory_vs_size_plot(runs: pd.DataFrame, path: Path) -> Path:
    """Model-state bytes (left) and peak memory (right) per rank against trainable parameters,
    one line per strategy."""
    summary = summarize(runs, ["strategy_label", "model.params_trainable"], ["peak_memory_bytes", "model_state_bytes"])
    palette = colours(list(summary["strategy_label"].unique()))
    kind = "device memory" if runs["peak_memory_kind"].iloc[0] == "device" else "resident memory (RSS)"
    unit, divisor = byte_unit(float(np.nanmax(summary[["peak_memory_bytes_median", "model_state_bytes_median"]].to_numpy())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), dpi=110)
    fig.suptitle(f"Memory per rank vs model size ({hardware(runs)})", fontsize=12, fontweight="bold")
    panels = [("model_state_bytes", "model state (params, grads, optimizer, master)"), ("peak_memory_bytes", f"peak {kind}")]
    for ax, (metric, title) in zip(axes, panels):
        for strategy, rows in summary.groupby("strategy_label"):
            rows = rows.sort_values("model.params_trainable")
            ax.plot(rows["model.params_trainable"], rows[f"{metric}_median"] / divisor, marker="o", color=palette[strategy],
                    label=strategy)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("trainable parameters")
        ax.set_ylabel(f"{unit} per rank")
        ax.grid(True, alpha=0.3, which="both")
    axes[1].legend(fontsize=8)
    return save(fig, path)


def state_stack_plot(runs: pd.DataFrame, path: Path) -> Path:
    """Model-state bytes per rank, stacked by kind, per strategy, for the largest model."""
    largest = runs[runs["model.params_trainable"] == runs["model.params_trainable"].max()]
    largest = largest[largest["world_size"] == largest["world_size"].max()]
    summary = summarize(largest, ["strategy_label"], [p for p, _ in STATE_PARTS]).sort_values("strategy_label")
    fig, ax = figure(f"Model state per rank: {largest['model_label'].iloc[0]}, {largest['world_size'].iloc[0]} ranks", largest)
    parts = summary[[f"{column}_median" for column, _ in STATE_PARTS]].to_numpy(dtype=float)
    unit, divisor = byte_unit(float(np.nansum(parts, axis=1).max()))
    bottom = np.zeros(len(summary))
    for column, label in STATE_PARTS:
        values = np.nan_to_num(summary[f"{column}_median"].to_numpy(dtype=float)) / divisor
        ax.bar(summary["strategy_label"], values, bottom=bottom, label=label)
        bottom += values
    ax.set_ylabel(f"{unit} per rank")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
    ax.legend(fontsize=8)
    return save(fig, path)


# Which plots each study gets (others get DEFAULT_PLOTS); name -> function.
PLOTS: dict[str, Callable[[pd.DataFrame, Path], Path]] = {
    "speedup": speedup_plot, "efficiency": efficiency_plot, "weak_throughput": weak_throughput_plot,
    "comm_overhead": comm_overhead_plot, "throughput": throughput_plot, "memory_vs_size": memory_vs_size_plot,
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
    return [PLOTS[name](runs, directory / f"{study}_{name}.png") for name in names]
