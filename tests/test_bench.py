"""``kanscale bench``: a quick run end to end, its memory counting, and its flag errors."""

import json

import pytest
import torch
from torch import nn

from launchers.bench import make_plan, measure_workload, saved_bytes
from launchers.bench_catalog import DEFAULT_IMPLS, IMPLEMENTATIONS, WORKLOADS
from launchers.cli import main


@pytest.mark.slow  # the slow tier (make test-slow)
def test_quick_bench_writes_json_and_a_markdown_table_with_ratios(tmp_path, capsys):
    out = tmp_path / "bench" / "tiny.json"
    code = main(
        [
            "bench",
            "--models",
            "tiny",
            "--impl",
            "pykan,reference,fast,fast-sparse,fast+step,mlp",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["impl"]: r for r in doc["results"]}
    assert list(rows) == ["pykan", "reference", "fast", "fast-sparse", "fast+step", "mlp"]
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in rows.values())
    assert rows["pykan"]["vs_pykan"] == 1.0 and rows["reference"]["vs_reference"] == 1.0
    assert rows["fast"]["vs_pykan"] == pytest.approx(rows["fast"]["samples_per_s"] / rows["pykan"]["samples_per_s"])
    for r in rows.values():
        assert r["step_ms"]["min"] <= r["step_ms"]["median"] <= r["step_ms"]["max"]
    # the fast layer keeps only its inputs for backward; the reference keeps the recursion's tensors
    assert rows["fast"]["saved_bytes"] < rows["reference"]["saved_bytes"] / 4
    # the whole step compiled: its first step is the compile time; the sparse product keeps only inputs too
    assert rows["fast+step"]["compile_s"] > rows["fast+step"]["step_ms"]["max"] / 1e3
    assert rows["fast-sparse"]["saved_bytes"] == rows["fast"]["saved_bytes"]
    assert doc["environment"]["threads"] == 1 and doc["environment"]["torch"] == torch.__version__
    # the arithmetic limit: 6 x batch x parameters at the measured GEMM rate, over the step
    rate = doc["environment"]["gemm_flops_per_s"]
    assert rate > 1e8
    for r in rows.values():
        assert r["step_flops"] == 6 * doc["workloads"]["tiny"]["batch"] * r["params"]
        assert r["limit_fraction"] == pytest.approx(r["step_flops"] / rate / (r["step_ms"]["median"] / 1e3))
    table = out.with_suffix(".md").read_text()
    assert "| impl |" in table and "x pykan" in table and "x reference" in table and "| of limit |" in table
    assert "| fast |" in table and "widths [2, 8, 1]" in table
    captured = capsys.readouterr()
    assert table.strip() in captured.out
    assert "[bench] tiny fast: step" in captured.err  # progress, one line per measurement


def test_saved_bytes_counts_each_saved_storage_once_without_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.rand(16, 4)
    # Linear saves its input x (16*4 floats); Tanh saves its output (16*8), which the second
    # Linear saves again as its input (same storage); weights are parameters.
    assert saved_bytes(model, lambda: model(x).sum()) == (16 * 4 + 16 * 8) * 4


def test_pykan_is_skipped_on_the_wide_workload_with_the_reason():
    (row,) = measure_workload("wide", ["pykan"], make_plan("wide", "pykan", 1, None, "cpu"))
    assert row["status"] == "skipped" and "Python" in row["note"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--impl", "fastest"], "--impl: unknown name 'fastest'"),
        (["--models", "huge"], "--models: unknown name 'huge'; choose from study, wide, fine, tiny"),
        (["--threads", "0"], "--threads: must be at least 1"),
        (["--repeats", "0"], "--repeats: must be at least 1"),
        (["--out", "table.md"], "--out: give a .json file (the Markdown table goes next to it as .md), got table.md"),
    ],
)
def test_bad_flags_exit_2_with_one_clean_message(capsys, flags, message):
    assert main(["bench", "--models", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_implementations_of_a_workload_take_their_rounds_in_turn():
    """A, B, A, B, ...: a load change halfway through the run slows every row alike."""
    measured = {}
    rows = measure_workload("tiny", ["fast", "mlp"], make_plan("tiny", "fast,mlp", 1, 3, "cpu"), measured=measured)
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["impl"] for r in rows] == ["fast", "mlp"]
    w = WORKLOADS["tiny"]
    assert w.settle == 1  # each turn: an untimed settling step, then the timed one
    order = [impl for _, impl in sorted((t, impl) for impl in ("fast", "mlp") for t in measured[impl].starts)]
    assert order == (["fast"] * 2 + ["mlp"] * 2) * (w.warmup + 3)
    assert len(measured["fast"].phases["step_ms"]) == 3  # only the timed steps count


def test_help_names_every_workload_and_implementation_the_bench_accepts(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in [*WORKLOADS, *IMPLEMENTATIONS]:
        assert f"{name}," in shown or f"{name} (" in shown or f"{name})" in shown, name
    assert "(default: " + ", ".join(DEFAULT_IMPLS) + ")" in shown
    assert f"{next(iter(WORKLOADS))} {next(iter(WORKLOADS.values())).repeats}" in shown
    for name in IMPLEMENTATIONS:  # and accepts what it names
        assert make_plan("tiny", name, 1, None, "cpu").impls == [name]
