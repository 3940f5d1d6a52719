"""Tables that compare strategies, built from the run table of :func:`analysis.records.load.load_runs`.

Every table exists twice: numbers (CSV, for further work) and formatted text (Markdown/HTML).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from analysis.report.derive import summarize, with_spread
from analysis.report.format import human_bytes

Formatter = Callable[[float], str]


def count(v: float) -> str:
    return f"{v:,.0f}"


def fixed(digits: int) -> Formatter:
    return lambda v: f"{v:.{digits}f}"


def percent(v: float) -> str:
    return "n/a" if pd.isna(v) else f"{100 * v:.1f}%"


def general(v: float) -> str:
    return f"{v:.4g}"


@dataclass(frozen=True)
class Column:
    metric: str  # a column of the derived run table
    header: str
    fmt: Formatter
    window: tuple[str, str] | None = None  # the columns of a run's slowest and fastest window, where it has them


SAMPLES = Column("samples_per_s", "samples/s", count, window=("samples_per_s_low", "samples_per_s_high"))
PER_RANK = Column("samples_per_s_per_rank", "samples/s per rank", count)
SPEEDUP = Column("speedup", "speedup", fixed(2))
EFFICIENCY = Column("efficiency", "efficiency", percent)
RETENTION = Column("retention", "per-rank retention", percent)
COMM = Column("comm_overhead", "comm overhead", percent)
STEP_MS = Column("step_ms", "step ms", fixed(2))
DATA_MS = Column("data_ms", "data ms", fixed(2))
COMPUTE_MS = Column("compute_ms", "compute ms", fixed(2))
COMM_MS = Column("comm_ms", "exposed comm ms", fixed(2))
CHECK_MS = Column("comm_check_ms", "blocked ms (check)", fixed(2))
PEAK = Column("peak_memory_bytes", "peak memory / rank", human_bytes)
STATE = Column("model_state_bytes", "model state / rank", human_bytes)
STATE_PARAMS = Column("memory.model_state.params", "params bytes", human_bytes)
STATE_GRADS = Column("memory.model_state.grads", "grads bytes", human_bytes)
STATE_OPT = Column("memory.model_state.optimizer", "optimizer bytes", human_bytes)
STATE_MASTER = Column("memory.model_state.master_params", "fp32 master bytes", human_bytes)
PER_BYTE = Column("params_per_byte", "params / byte of peak", lambda v: f"{v:.3g}")
LOSS = Column("final_loss", "final loss", general)
ACTIVATIONS = Column("activations_bytes", "activations / rank", human_bytes)
ACTIVATION_SHARE = Column("activations_share", "activations / step peak", percent)
GFLOPS = Column("model_gflops_per_rank", "model GFLOP/s / rank", fixed(2))
MFU = Column("mfu", "MFU", percent)

# Which columns each study's table shows; any other study gets DEFAULT.
STUDY_COLUMNS: dict[str, list[Column]] = {
    "strong": [SAMPLES, SPEEDUP, EFFICIENCY, COMM, GFLOPS, MFU, PEAK, ACTIVATIONS, LOSS],
    "weak": [SAMPLES, PER_RANK, RETENTION, COMM, GFLOPS, MFU, LOSS],
    "comm": [STEP_MS, DATA_MS, COMPUTE_MS, COMM_MS, CHECK_MS, COMM, SAMPLES],
    "loader": [SAMPLES, STEP_MS, DATA_MS, COMPUTE_MS, COMM_MS, LOSS],
    "model_size": [SAMPLES, COMM, GFLOPS, MFU, PEAK, STATE, ACTIVATIONS, LOSS],
    "memory": [
        PEAK,
        STATE,
        STATE_PARAMS,
        STATE_GRADS,
        STATE_OPT,
        STATE_MASTER,
        ACTIVATIONS,
        ACTIVATION_SHARE,
        PER_BYTE,
    ],
    "activation_memory": [SAMPLES, PER_RANK, GFLOPS, MFU, PEAK, ACTIVATIONS, ACTIVATION_SHARE, LOSS],
}
DEFAULT = [SAMPLES, SPEEDUP, EFFICIENCY, COMM, GFLOPS, MFU, PEAK, STATE, ACTIVATIONS, ACTIVATION_SHARE, LOSS]
ROW_KEYS = ["strategy_label", "model.params_trainable", "topology_label", "topology.world_size"]
SPLIT_KEYS = ["model_label", "batch.micro_batch"]
ROW_HEADERS = {
    "strategy_label": "strategy",
    "model.params_trainable": "params",
    "topology_label": "nodes x ranks",
    "model_label": "model",
    "batch.micro_batch": "micro-batch",
}


@dataclass
class Table:
    """A table as numbers (``data``) and as text (``text``), with a caption."""

    name: str
    caption: str
    data: pd.DataFrame
    text: pd.DataFrame

    def markdown(self) -> str:
        return f"{self.caption}\n\n{self.text.to_markdown(index=False)}\n"


def study_table(derived: pd.DataFrame, study: str, peak_source: str | None = None) -> Table:
    """The study's table; ``peak_source`` says where the peak rate MFU is against came from
    (None: no peak was given, and no MFU column)."""
    runs = derived[derived["study"] == study]
    columns = [c for c in STUDY_COLUMNS.get(study, DEFAULT) if c is not MFU or peak_source]
    metrics = [c.metric for c in columns] + [w for c in columns for w in c.window or ()]
    # a model or micro-batch that differs among a strategy's runs of one size is a row of its own
    keys = ROW_KEYS + [k for k in SPLIT_KEYS if not runs.empty and runs.groupby(ROW_KEYS)[k].nunique().max() > 1]
    summary = summarize(runs, keys, metrics).sort_values(
        ["model.params_trainable", *keys[4:], "strategy_label", "topology.world_size", "topology_label"]
    )
    text = summary[ROW_KEYS[:3] + keys[4:]].rename(columns=ROW_HEADERS)
    text["params"] = text["params"].map(count)
    for column in columns:
        text[column.header] = with_spread(summary, column.metric, column.fmt, column.window).values
    if (summary["repeats"] > 1).any():
        text["runs"] = summary["repeats"].values
    windowed = (
        " and [slowest-fastest timing window] of samples/s for a point run once"
        if any(c.window for c in columns)
        else ""
    )
    caption = (
        f"Study `{study}`: {len(runs)} run(s) on {hardware(runs)}. Speedup and efficiency are against the "
        f"{baseline_phrase(runs)}; medians, with [min-max] where a point was repeated{windowed}."
        + (COUNTED_STEP if any(c in columns for c in (ACTIVATIONS, GFLOPS)) else "")
        + (f" MFU: model FLOP/s per rank over {peak_source}." if peak_source else "")
    )
    return Table(study, caption, summary.reset_index(drop=True), text.reset_index(drop=True))


COUNTED_STEP = (
    " Activations: what a forward left for its backward on the counted step (the last warm-up step), "
    "their share of that step's tensor peak; model FLOP/s: that step's model FLOPs per sample (matrix "
    "products by torch's FlopCounterMode, recomputation excluded) times samples/s per rank."
)


def baseline_phrase(runs: pd.DataFrame) -> str:
    """Which 1-rank runs the speedups of ``runs`` are measured against, in words."""
    kinds = set(runs["baseline"].dropna())
    own = "1-rank run of the same strategy and experiment"
    single = "one-process `single` run with the same global batch"
    if kinds == {"single process"}:
        return single
    if kinds == {"own 1-rank", "single process"}:
        return f"{own} where there is one, else the {single}"
    return own


def hardware(runs: pd.DataFrame) -> str:
    devices = sorted({f"{row['topology.device_name']} ({row['topology.device_type']})" for _, row in runs.iterrows()})
    backends = sorted({str(b) for b in runs["topology.comm_backend"].dropna().unique()})
    return "; ".join(devices) + (f", {'/'.join(backends)} collectives" if backends else "")


QUICK_COLUMNS = {
    "strategy_label": "strategy",
    "topology_label": "nodes x ranks",
    "model.params_trainable": "params",
    "throughput.samples_per_s": "samples/s",
    "comm_overhead": "comm overhead",
    "model_state_bytes": "model state / rank",
    "final_loss": "final loss",
}


def quick_comparison(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run: samples/s, exposed-communication share, model-state bytes per
    rank and final loss; smallest model first, then fastest first."""
    ok = runs[runs["status"] == "ok"].sort_values(
        ["model.params_trainable", "throughput.samples_per_s"], ascending=[True, False]
    )
    table = ok[list(QUICK_COLUMNS)].rename(columns=QUICK_COLUMNS)
    table["params"] = table["params"].map(count)
    table["samples/s"] = table["samples/s"].map(count)
    one_process = ok["topology.world_size"].to_numpy() == 1
    table["comm overhead"] = [
        f"{'not measured' if pd.isna(v) else percent(v)} beyond compute (1 process)"
        if single
        else "not measured"
        if pd.isna(v)
        else percent(v)
        for v, single in zip(table["comm overhead"], one_process, strict=True)
    ]
    table["model state / rank"] = table["model state / rank"].map(human_bytes)
    table["final loss"] = table["final loss"].map(general)
    return table.reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False)
