"""Measurement honesty: no negative time reported as a measurement, a one-process figure named
for what it is, outside load detected and caveated, and a compute baseline that can be switched
off or kept to a sharding strategy's share."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.records.load import load_runs
from analysis.records.run_files import read_steps, read_summary
from analysis.records.schema import OutsideLoad
from analysis.report.derive import derive
from analysis.report.verdict import verdict
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import load_experiment
from strategies.lifecycle.preflight import preflight
from strategies.measure.comm_exposure import WindowTimes, exposure, trusted_seconds
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")


def windows(replica_ms, blocked_ms, step_ms=10.0):
    return [
        WindowTimes(step_s=step_ms / 1e3, data_s=0.0, compute_s=(step_ms - r) / 1e3, blocked_s=b / 1e3)
        for r, b in zip(replica_ms, blocked_ms, strict=True)
    ]


def test_a_negative_check_is_never_the_runs_measurement():
    """A one-process run on a loaded machine can read a negative blocked time."""
    comm = exposure(windows([1.0, 1.2, 0.9], [-4.26, -4.0, -4.5]), 0.01, check_valid=True, communicates=False)
    assert comm.check is None and comm.trusted == "replica"
    assert "-4.26 ms" in comm.note and "not a measurement" in comm.note
    assert comm.note.startswith("one process, so no communication") and "overhead beyond compute" in comm.note
    assert trusted_seconds(comm) == pytest.approx(1.0e-3)


def test_a_negative_replica_gives_way_to_the_check_or_to_no_figure():
    with_check = exposure(windows([-3.0, -2.5, -2.8], [1.0, 1.1, 0.9]), 0.01, check_valid=True)
    assert with_check.trusted == "check" and trusted_seconds(with_check) == pytest.approx(1.0e-3)
    alone = exposure(windows([-3.0, -2.5, -2.8], [0.0] * 3), 0.01, check_valid=False)
    assert alone.trusted == "none" and trusted_seconds(alone) is None and "not a measurement" in alone.note
    # a reading just below zero is zero within noise, still not a negative measurement
    tiny = exposure(windows([1.0] * 3, [-0.05, -0.04, -0.06]), 0.01, check_valid=True)
    assert tiny.check is None and "zero within noise" in tiny.note


def test_a_one_process_run_calls_its_figure_overhead_beyond_compute(tmp_path, capsys):
    assert main(["train", QUICKSTART, "--out", str(tmp_path), "--set", "training.epochs=1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "overhead beyond compute (1 process: no comm)" in printed and "comm overhead" not in printed
    assert main(["analyze", str(tmp_path)]) == 0
    analyzed = capsys.readouterr().out
    assert "beyond compute (1 process" in analyzed


def test_the_replica_baseline_takes_off_its_tensors_not_its_steps_working_memory(tmp_path):
    """What the replica holds is its parameters and Adam's state (its gradients are freed after
    each step), counted from its tensors. A resident-memory difference across its warm-up also
    counted its step's working memory, which the training's step reuses, and so took that off the
    training's peak as well (the 4M RBF KAN's DDP peak read 546 MiB, 601 MiB without a baseline)."""
    assert (
        main(
            [
                "train",
                QUICKSTART,
                "--out",
                str(tmp_path),
                "--set",
                "model.widths=[2,256,256,1]",
                "--set",
                "training.steps=12",
                "--set",
                "measurement.baseline=replica",
                "--no-progress",
            ]
        )
        == 0
    )
    record = read_summary(next(tmp_path.iterdir()))
    state = record.memory.model_state  # counted at the last step, the same model and optimizer
    assert record.memory.replica_bytes == state.params + state.optimizer


def test_baseline_off_records_no_exposed_communication(tmp_path, capsys):
    # unquoted off, as a user types it (YAML 1.1 reads it as false)
    assert (
        main(
            [
                "train",
                QUICKSTART,
                "--out",
                str(tmp_path),
                "--set",
                "training.epochs=1",
                "--set",
                "measurement.baseline=off",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "overhead beyond compute (1 process: no comm) not measured" in capsys.readouterr().out
    run_dir = next(tmp_path.iterdir())
    record = read_summary(run_dir)
    assert record.status == "ok" and record.measurement.baseline == "off" and record.measurement.baseline_steps == 0
    assert record.comm.trusted == "none" and "measurement.baseline off" in record.comm.note
    assert record.comm_overhead is None and record.timings.comm_exposed_s is None and record.timings.compute_s is None
    assert record.memory.replica_bytes == 0 and record.throughput.samples_per_s > 0
    assert all(s.comm_s_max is None for s in read_steps(run_dir / "steps.jsonl"))
    assert main(["analyze", str(tmp_path)]) == 0
    assert "not measured beyond compute (1 process: no comm)" in capsys.readouterr().out  # never "comm"


@pytest.mark.parametrize(
    "preset, world, compile, expected",
    [
        ("fsdp2", 2, "none", "layerwise"),
        ("zero3", 2, "none", "layerwise"),
        ("zero1", 2, "none", "layerwise"),
        ("fsdp1", 2, "none", "layerwise"),
        ("fsdp2", 2, "model", "replica"),
        ("ddp", 2, "none", "replica"),
        ("zero0", 2, "none", "replica"),
        ("tp", 2, "none", "replica"),
        ("fsdp2_tp", 4, "none", "replica"),
        ("single", 1, "none", "replica"),
    ],
)
def test_auto_takes_the_layerwise_baseline_where_the_strategy_shards(preset, world, compile, expected):
    cfg = load_experiment(QUICKSTART, [f"training.compile={compile}"], strategy=preset)
    assert cfg.measurement.baseline_for(cfg.strategy.mesh_shape(world), cfg.training.compile) == expected


@pytest.mark.parametrize(
    "overrides, preset, world, words",
    [
        (["training.compile=model"], "fsdp2", 2, "training.compile is model"),
        ([], "tp", 2, "cuts each layer over tensor-parallel ranks"),
    ],
)
def test_layerwise_is_refused_before_launch_where_it_cannot_time_the_run(tmp_path, overrides, preset, world, words):
    base = [f"output.dir={tmp_path}", "measurement.baseline=layerwise", *overrides]
    with pytest.raises(ConfigError, match=re.escape("measurement.baseline: layerwise")) as refused:
        preflight(load_experiment(QUICKSTART, base, strategy=preset), "cpu", world)
    assert words in str(refused.value) and "measurement.baseline=replica" in str(refused.value)
    # the fix the message gives
    preflight(load_experiment(QUICKSTART, [*base, "measurement.baseline=replica"], strategy=preset), "cpu", world)


def test_a_sharded_run_takes_the_layerwise_baseline_by_default(tmp_path):
    """At 2 ranks under torchrun: a real measurement (its memory is tested under a cap in
    tests/test_baseline_memory.py, at a size where RSS can tell)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "launchers.cli",
            "train",
            QUICKSTART,
            "--strategy",
            "fsdp2",
            "--set",
            "training.steps=30",
            "--set",
            "training.epochs=null",
            "--set",
            "model.widths=[2,256,1]",
            "--out",
            str(tmp_path),
            "--no-progress",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    record = read_summary(next(tmp_path.iterdir()))
    assert record.status == "ok" and record.measurement.baseline == "layerwise"
    assert "sharded units one at a time" in record.measurement.comm_method
    assert 0 < record.timings.compute_s < record.timings.step_mean_s
    assert record.comm.trusted in ("replica", "check") and record.comm_overhead > 0


def test_outside_load_is_measured_and_the_verdict_says_the_machine_was_shared(tmp_path):
    # The run in a process of its own, as users start it: the hog is its sibling, not its child.
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "launchers.cli",
                "train",
                QUICKSTART,
                "--out",
                str(tmp_path),
                "--set",
                "training.epochs=4",
                "--no-progress",
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )
    finally:
        hog.kill()
        hog.wait()
    record = read_summary(next(tmp_path.iterdir()))
    load = record.measurement.outside_load
    assert load is not None and load.cores_busy > 0.5 and load.run_cores_busy > 0, load
    notes = verdict(derive(load_runs(tmp_path)[0])).scales[0].caveats
    assert any("the machine was shared" in n and f"{load.cores_busy:.2f} core(s)" in n for n in notes), notes


@pytest.mark.parametrize("cores_busy, shared", [(0.02, False), (0.9, True)])
def test_the_shared_machine_caveat_needs_real_outside_load(tmp_path, cores_busy, shared):
    for i, strategy in enumerate(("single", "ddp")):
        record = make_record(f"r{i}", strategy=strategy, world=1 + i, cpus=2)
        measurement = record.measurement.model_copy(
            update={"outside_load": OutsideLoad(cores_busy=cores_busy, run_cores_busy=1.0, cores=2, seconds=1.0)}
        )
        write_record(tmp_path, record.model_copy(update={"measurement": measurement}))
    notes = verdict(derive(load_runs(tmp_path)[0])).scales[0].caveats
    assert any("the machine was shared" in n for n in notes) == shared
