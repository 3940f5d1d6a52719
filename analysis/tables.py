"""Tables that compare strategies, built from the run table of :func:`analysis.load.load_runs`."""

from __future__ import annotations

import pandas as pd

from analysis.format import human_bytes

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
    ok = runs[runs["status"] == "ok"].sort_values(["model.params_trainable", "throughput.samples_per_s"], ascending=[True, False])
    table = ok[list(QUICK_COLUMNS)].rename(columns=QUICK_COLUMNS)
    table["params"] = table["params"].map(lambda v: f"{v:,}")
    table["samples/s"] = table["samples/s"].map(lambda v: f"{v:,.0f}")
    table["comm overhead"] = table["comm overhead"].map(lambda v: f"{100 * v:.1f}%")
    table["model state / rank"] = table["model state / rank"].map(human_bytes)
    table["final loss"] = table["final loss"].map(lambda v: f"{v:.4g}")
    return table.reset_index(drop=True)


def markdown(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False)
