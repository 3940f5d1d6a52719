"""Activations and achieved FLOP/s in the report: the tables' columns, MFU against a peak given to
``kanscale analyze`` (a number, a cluster file, or this machine's GEMM rate), and refusals of a bad
peak naming the flag and the fix, which the tests follow."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.records.schema import Flops, TensorMemory
from analysis.report.budget import largest_batch
from launchers.cli import main
from tests.helpers.records import make_record, write_record

MiB = 2**20


def counted(run_id: str, activations: int, checkpointed: bool, samples_per_s: float = 1000.0, micro_batch: int = 64):
    """A 2-rank ddp record whose counted step kept ``activations`` bytes, at a peak 4 MiB above them."""
    record = make_record(run_id, world=2, samples_per_s=samples_per_s, micro_batch=micro_batch)
    state = {"parameters": MiB, "buffers": 0, "gradients": MiB, "optimizer": 2 * MiB, "temporaries": 0, "other": 0}
    peak = TensorMemory(**state, activations=activations, peak=4 * MiB + activations)
    memory = record.memory.model_copy(
        update={
            "activation_checkpointing": "layers" if checkpointed else "none",
            "checkpointed_units": 2 if checkpointed else 0,
            "activations_after_forward_bytes": activations,
            "step_peak": peak,
        }
    )
    return record.model_copy(
        update={"memory": memory, "flops": Flops(step=5, model_per_sample=6e6, hardware_per_sample=8e6)}
    )


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    write_record(runs, counted("plain", 40 * MiB, False))
    write_record(runs, counted("checkpointed", 4 * MiB, True, samples_per_s=800.0))
    return runs


def table(out) -> pd.DataFrame:
    return pd.read_csv(out / "strong.csv")


def test_tables_show_activations_and_model_flops_per_strategy_and_mode(runs, tmp_path, capsys):
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report")]) == 0
    verdict = capsys.readouterr().out
    assert "ddp+checkpointed" in verdict and "4.0 MiB" in verdict and "40.0 MiB" in verdict
    text = (tmp_path / "report" / "strong.md").read_text()
    assert "activations / rank" in text and "model GFLOP/s / rank" in text and "| MFU" not in text
    data = table(tmp_path / "report").set_index("strategy_label")
    # 6 MFLOP a sample at 500 samples/s per rank (1000 over 2 ranks): 3 GFLOP/s
    assert data.loc["ddp", "model_gflops_per_rank_median"] == pytest.approx(3.0)
    assert data.loc["ddp+checkpointed", "activations_bytes_median"] == 4 * MiB


def test_mfu_is_taken_against_the_peak_given(runs, tmp_path):
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report"), "--peak-tflops", "0.006"]) == 0
    data = table(tmp_path / "report").set_index("strategy_label")
    assert data.loc["ddp", "mfu_median"] == pytest.approx(0.5)  # 3 GFLOP/s of 6
    caption = (tmp_path / "report/strong.md").read_text()
    assert "MFU: model FLOP/s per rank over 0.006 TFLOP/s (--peak-tflops)" in caption


def test_a_peak_that_is_not_a_rate_is_refused_naming_the_fix(runs, tmp_path, capsys):
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report"), "--peak-tflops", "fast"]) == 2
    err = capsys.readouterr().err
    assert "--peak-tflops is 'fast'" in err and "--peak-tflops gemm" in err
    assert not (tmp_path / "report").exists()
    # the fix it names: measure this machine's
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report"), "--peak-tflops", "gemm"]) == 0
    assert "dense float32 GEMM rate on 1 thread(s)" in (tmp_path / "report/strong.md").read_text()
    assert table(tmp_path / "report")["mfu_median"].between(0, 1).all()


def test_a_cluster_file_without_a_device_rate_is_refused_naming_the_key(runs, tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    links = "links: {intra: {alpha_us: 5, busbw_GBps: 100}}\n"
    cluster.write_text("name: lab\nranks_per_node: 2\noverlap: true\n" + links)
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report"), "--cluster", str(cluster)]) == 2
    assert "device_tflops: missing; give the achieved rate per device in TFLOP/s" in capsys.readouterr().err
    cluster.write_text("name: lab\nranks_per_node: 2\noverlap: true\ndevice_tflops: 0.012\n" + links)
    assert main(["analyze", str(runs), "--out", str(tmp_path / "report"), "--cluster", str(cluster)]) == 0
    assert table(tmp_path / "report").set_index("strategy_label").loc["ddp", "mfu_median"] == pytest.approx(0.25)


def test_the_budget_table_gives_the_largest_micro_batch_by_mode_and_the_throughput_cost(tmp_path, capsys):
    runs = tmp_path / "runs"
    for batch in (64, 128):  # 40 KiB a sample without checkpointing, 4 KiB with, 4 MiB whatever the batch
        write_record(runs, counted(f"plain{batch}", 40 * 1024 * batch, False, micro_batch=batch))
        write_record(runs, counted(f"ckpt{batch}", 4 * 1024 * batch, True, samples_per_s=800.0, micro_batch=batch))
    out = tmp_path / "report"
    assert main(["analyze", str(runs), "--out", str(out), "--memory-budget", "1"]) == 0
    data = pd.read_csv(out / "memory_budget.csv").iloc[0]
    assert data["bytes_per_sample"] == pytest.approx(40 * 1024) and data["checkpointed_throughput"] == 0.8
    # (1 GiB - 4 MiB) / 40 KiB and / 4 KiB
    assert data["largest_micro_batch"] == "26,112" and data["largest_micro_batch_checkpointed"] == "261,120"
    assert "largest micro-batch in 1.0 GiB (projected)" in (out / "memory_budget.md").read_text()
    assert "<h2>Memory budget: the largest micro-batch per rank</h2>" in (out / "report.html").read_text()
    # a budget the fixed part alone exceeds fits no batch, and says what it holds
    assert main(["analyze", str(runs), "--out", str(out), "--memory-budget", "0.001"]) == 0
    assert pd.read_csv(out / "memory_budget.csv").iloc[0]["largest_micro_batch"] == "none: 4.0 MiB before any sample"


def test_a_budget_that_is_not_positive_is_refused_naming_the_fix(tmp_path, capsys):
    assert main(["analyze", str(tmp_path), "--memory-budget", "-1"]) == 2
    assert "--memory-budget is -1; give the memory of one rank in GiB" in capsys.readouterr().err


def test_a_budget_holding_a_whole_number_of_samples_is_not_cut_by_the_fits_rounding():
    budget, fixed = 1024**3, 4 * 1024**2
    one_ulp_steep = math.nextafter(40 * 1024.0, math.inf)  # what np.polyfit may return for 40 KiB
    assert largest_batch((fixed, one_ulp_steep), budget) == "26,112"
    assert largest_batch((fixed, 40 * 1024.0 + 1), budget) == "26,111"  # a real byte more a sample still counts
