"""Load every run record under a directory into one pandas table, one row per run.

Records that cannot be read are reported, not raised: one corrupt file must not hide the rest.
Failed and incomplete runs are rows too, with their status. A directory that does not exist is
the one refusal: it is a mistyped path, not a set of runs with none finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.records.consistency import inconsistencies
from analysis.records.labels import strategy_label, topology_label
from analysis.records.run_files import CONFIG_FILE, STEPS_FILE, SUMMARY_FILE, RecordError, read_summary
from analysis.records.schema import RunRecord
from kanscale.directories import runs_directory
from kanscale.errors import ConfigError
from kanscale.files import read_mapping
from kanscale.identity import digest, identity


# What reading one record may raise besides RecordError: an I/O error (a failing disk, a
# permission), bytes that are not text, JSON nested deeper than the decoder recurses.
@dataclass(frozen=True)
class Problem:
    path: Path
    message: str


def repeat_identity(record: RunRecord, run_dir: Path) -> dict:
    """What a run is as a point of a comparison: its experiment (config.yaml) but for the seed and
    where it was written. Runs with equal identities are repeats of one point; a run without a
    readable config.yaml is known by its config digest alone."""
    try:
        return identity(read_mapping(run_dir / CONFIG_FILE), seed=False)
    except (ConfigError, OSError):
        return {"config_digest": record.config_digest}


def record_row(record: RunRecord, run_dir: Path) -> dict:
    """A flat row: nested fields joined with dots (``timings.step_mean_s``), plus the labels and
    model-state total the tables group and sort by, and the run's repeat identity (``repeat_key``,
    its hash, and ``repeat_config``, the identity itself)."""
    row = pd.json_normalize(record.model_dump(mode="json"), sep=".").iloc[0].to_dict()
    repeat = repeat_identity(record, run_dir)
    state = record.memory.model_state if record.memory else None
    row.update(
        {
            "run_dir": str(run_dir),
            "strategy_label": strategy_label(record),
            "topology_label": topology_label(record),
            # the reference B-spline layer is the same arithmetic as the fast one, not the same memory
            "model_label": f"{record.model.family} {record.model.widths}"
            + (" impl=reference" if record.model.options.get("impl") == "reference" else ""),
            "task_label": record.task.label or record.task.name,
            "model_state_bytes": (state.params + state.grads + state.optimizer + state.master_params)
            if state
            else None,
            "repeat_key": digest(repeat),
            "repeat_config": repeat,
        }
    )
    return row


def load_runs(directory: str | Path) -> tuple[pd.DataFrame, list[Problem]]:
    """Every run under ``directory``: one row per readable record that agrees with itself, one
    problem per run directory that has none (corrupt JSON, bytes that are not UTF-8, an
    unreadable file, an unknown schema version, a missing summary, a record that contradicts
    itself: analysis/records/consistency.py)."""
    directory = runs_directory(directory)
    rows, problems = [], []
    for summary in sorted(directory.rglob(SUMMARY_FILE)):
        try:
            record = read_summary(summary)
        except RecordError as err:  # every way a record can be unreadable (analysis/records/run_files.py)
            problems.append(Problem(summary, str(err)))
            continue
        contradictions = inconsistencies(record)
        if contradictions:  # hand-edited, or wrong: kept out of every comparison
            problems.append(Problem(summary, f"{summary}: the record contradicts itself: {'; '.join(contradictions)}"))
            continue
        rows.append(record_row(record, summary.parent))
    for leftover in sorted({p.parent for name in (STEPS_FILE, CONFIG_FILE) for p in directory.rglob(name)}):
        if not (leftover / SUMMARY_FILE).exists():
            problems.append(
                Problem(
                    leftover,
                    f"{leftover}: has {STEPS_FILE} or {CONFIG_FILE} but no {SUMMARY_FILE}; "
                    "the run left no record to analyse",
                )
            )
    return pd.DataFrame(rows), problems
