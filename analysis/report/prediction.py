"""What ``kanscale recommend --validate`` predicted for the runs it trained (``recommendation.json``
beside them), as a report table: predicted against measured rate, peak memory and model state."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.report.format import human_bytes
from analysis.report.tables import Table

PREDICTION_FILE = "recommendation.json"


def prediction_table(runs_dir: Path) -> Table | None:
    """The table, where ``runs_dir`` holds a recommendation's validation; None where it does not
    (or the file is not one: it is reported, not trusted)."""
    path = Path(runs_dir) / PREDICTION_FILE
    try:
        doc = json.loads(path.read_text())
        rows = [r for r in doc["validation"] if r.get("status") == "ok"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not rows:
        return None
    data = pd.DataFrame(rows)
    text = pd.DataFrame(
        {
            "strategy": data["strategy"],
            "predicted #": data["predicted_rank"],
            "samples/s predicted": data["predicted_samples_per_s"].map("{:,.0f}".format),
            "measured": data["measured_samples_per_s"].map("{:,.0f}".format),
            "error": (data["predicted_samples_per_s"] / data["measured_samples_per_s"] - 1).map("{:+.0%}".format),
            "peak predicted": data["predicted_peak_bytes"].map(human_bytes),
            "peak measured": data["measured_peak_bytes"].map(human_bytes),
            "peak error": (data["predicted_peak_bytes"] / data["measured_peak_bytes"] - 1).map("{:+.0%}".format),
            "model state predicted": data["predicted_model_state_bytes"].map(human_bytes),
            "measured state": data["measured_model_state_bytes"].map(human_bytes),
        }
    )
    caption = (
        f"kanscale recommend's prediction ({path.name}) beside what these runs measured: the predicted numbers "
        "are projections from 1-rank probes and the network model (docs/recommend.md)."
    )
    return Table("recommend", caption, data, text)
