"""The shipped activation_memory study, as docs/memory.md runs it (one family, width and strategy
of its matrix, both micro-batches and both checkpointing modes), and its report's budget table."""

from __future__ import annotations

import pandas as pd
import pytest

from launchers.cli import main
from tests.helpers.launch import ROOT

pytestmark = pytest.mark.slow  # four 2-rank launches

STUDY = str(ROOT / "configs/studies/activation_memory_cpu.yaml")


def test_the_study_runs_and_its_report_gives_the_largest_batch_per_mode(tmp_path, capsys):
    runs, report = tmp_path / "runs", tmp_path / "report"
    only = ["--only", "family=rbf", "--only", "width=w256", "--only", "strategy=ddp"]
    assert main(["sweep", STUDY, "--out", str(runs), *only, "--set", "training.steps=4"]) == 0
    assert main(["analyze", str(runs), "--out", str(report), "--memory-budget", "1"]) == 0
    table = pd.read_csv(report / "activation_memory.csv")
    # a row per strategy, mode and micro-batch: each micro-batch is a point of its own
    points = set(zip(table["strategy_label"], table["batch.micro_batch"], strict=True))
    assert points == {(s, b) for s in ("ddp", "ddp+checkpointed") for b in (256, 1024)}
    budget = pd.read_csv(report / "memory_budget.csv")
    assert len(budget) == 1 and budget.loc[0, "strategy.label"] == "ddp"
    row = budget.iloc[0]
    # the peak falls by less than what the forward keeps: in the backward one layer's are alive again
    assert 0 < row["bytes_per_sample_checkpointed"] < 0.8 * row["bytes_per_sample"]
    kept = table[table["batch.micro_batch"] == 1024].set_index("strategy_label")["activations_bytes_median"]
    assert kept["ddp+checkpointed"] <= kept["ddp"] / 10
    without, with_ = (int(row[c].replace(",", "")) for c in ("largest_micro_batch", "largest_micro_batch_checkpointed"))
    assert 1024 < without < with_  # 1 GiB holds more than the batches measured, and more with checkpointing
    assert row["checkpointed_throughput"] > 0
    page = (report / "report.html").read_text()
    assert "Memory budget: the largest micro-batch per rank" in page and "ddp+checkpointed" in page
