"""A run whose disk fills up, on a real full filesystem (a small tmpfs, mounted for the test):
the run stops with a clear message naming the path and the errno, its record ends ``failed`` with
that error (the room for it was reserved when the run started), the partial checkpoint is gone,
the earlier ones are intact and resume, and steps.jsonl holds no torn line."""

import errno
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from analysis.records.run_files import read_steps, read_summary
from launchers.cli import main
from strategies.lifecycle.checkpoint import complete_checkpoints, verify
from tests.helpers.launch import ROOT, child_env

PAGE = 4096
# At least the room a run of one or two ranks reserves on a tmpfs for recording a failure
# (strategies/lifecycle/disk.py: 128 KiB and a page per file); the disks below are sized with it.
RESERVE = 160 * 1024


def mount_tmpfs(where: Path, size: int) -> None:
    """A tmpfs of ``size`` bytes at ``where``, or skip: mounting needs root and a kernel that lets
    this process mount (not every container does)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is made by mounting a small tmpfs, which needs root")
    if shutil.which("mount") is None:
        pytest.skip("a full disk is made by mounting a small tmpfs, and this machine has no mount command")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that size; every one is unmounted at teardown."""
    mounted = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], capture_output=True)  # still busy: detach it


def experiment(out: Path, **training) -> dict:
    """A checkpoint of about 700 KB (a [2, 2048, 1] spline KAN with Adam's state, well over twice RESERVE)
    every 3 steps."""
    return {
        "name": "full_disk",
        "model": {"family": "bspline", "widths": [2, 2048, 1], "grid": 3, "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 256, "n_test": 64},
        "training": {
            "seed": 3,
            "lr": 0.02,
            "micro_batch": 32,
            "steps": 12,
            "warmup_steps": 1,
            "checkpoint_every": 3,
            **training,
        },
        "strategy": {"name": "single"},
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def train(config: dict, tmp_path: Path, *extra: str) -> int:
    path = tmp_path / f"{config['name']}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return main(["train", str(path), "--no-progress", *extra])


def pages(directory: Path) -> int:
    """What the files under ``directory`` take on a tmpfs: whole pages."""
    return sum(math.ceil(p.stat().st_size / PAGE) * PAGE for p in directory.rglob("*") if p.is_file())


def only_run(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def test_a_checkpoint_save_that_fills_the_disk_is_recorded_and_cleaned_up(tmp_path, small_disk, capsys):
    # the same run on a disk with room: what two checkpoints and the rest take
    assert train(experiment(tmp_path / "reference"), tmp_path) == 0
    reference = only_run(tmp_path / "reference")
    checkpoint = pages(reference / "checkpoints/step-000012")
    # room for everything with two checkpoints kept, and half of a third: the save after step 9 fails
    disk = small_disk(pages(reference) + RESERVE + checkpoint // 2)
    capsys.readouterr()
    assert train(experiment(disk / "runs"), tmp_path) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    run_dir = only_run(disk / "runs")
    partial = run_dir / "checkpoints/step-000009.tmp"
    assert err.startswith(
        f"kanscale: train failed: DiskFull: the disk is full: writing checkpoint {partial} failed with"
    )
    assert f"no space left on device (ENOSPC, errno {errno.ENOSPC})" in err

    record = read_summary(run_dir)
    assert record.status == "failed" and record.error.type == "DiskFull" and record.error.step == 9
    assert str(partial) in record.error.message and "ENOSPC" in record.error.message
    # nothing partial left, the reserve freed
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "checkpoints",
        "config.yaml",
        "failures",
        "steps.jsonl",
        "summary.json",
    ]
    kept = complete_checkpoints(run_dir)
    assert [c.path.name for c in kept] == ["step-000003", "step-000006"] and [verify(c) for c in kept] == [None, None]
    assert [s.step for s in read_steps(run_dir)] == list(range(1, 10))

    # the run, moved to a disk with room, resumes from step 6 and ends as the reference did
    moved = Path(shutil.copytree(run_dir, tmp_path / "moved" / run_dir.name))
    config = experiment(tmp_path / "moved")
    assert train(config, tmp_path, "--resume", str(moved)) == 0
    assert read_summary(moved).resumed_at_steps == [6]
    assert [s.loss for s in read_steps(moved)] == [s.loss for s in read_steps(reference)]


def test_steps_that_fill_the_disk_leave_a_failed_record_and_no_torn_line(tmp_path, small_disk, capsys):
    # no checkpoints: steps.jsonl is what grows (a line per step, appended every 10)
    disk = small_disk(RESERVE + 8 * PAGE)  # the reserve, config.yaml, summary.json, 6 pages of steps
    config = experiment(disk / "runs", steps=5000, checkpoint_every=0, log_every=10)
    config["model"]["widths"] = [2, 4, 1]
    assert train(config, tmp_path) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    run_dir = only_run(disk / "runs")
    assert err.startswith(
        f"kanscale: train failed: DiskFull: the disk is full: writing in the run directory {run_dir} "
        f"failed with [Errno {errno.ENOSPC}] No space left on device (ENOSPC)"
    )
    record = read_summary(run_dir)
    assert record.status == "failed" and record.error.type == "DiskFull" and "ENOSPC" in record.error.message
    steps = read_steps(run_dir)  # every line whole: a torn one mid-file would not read
    assert 10 <= len(steps) < 5000 and [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert (run_dir / "steps.jsonl").read_bytes().endswith(b"\n")
    assert record.error.step >= len(steps)


def test_a_disk_without_room_to_record_a_failure_is_refused_before_the_run_writes(tmp_path, small_disk, capsys):
    disk = small_disk(16 * PAGE)  # less than the reserve
    assert train(experiment(disk / "runs"), tmp_path) == 1
    err = capsys.readouterr().err
    run_dir = only_run(disk / "runs")
    assert (
        f"DiskFull: the disk is full: writing the run's space reserve {run_dir / '.space-reserve'} failed with" in err
    )
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no record claiming a run, no reserve left


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", [{"name": "fsdp2"}, {"name": "deepspeed", "zero_stage": 3}], ids=["fsdp2", "zero3"]
)
def test_a_sharded_save_that_fills_the_disk_on_two_ranks_is_recorded(tmp_path, small_disk, strategy):
    """World size 2 under the real launcher, every rank writing its own part of the checkpoint:
    DCP (fsdp2) gathers the ranks' errors into a CheckpointException, which is no Exception;
    DeepSpeed writes each partition with torch.save, whose error carries no errno."""

    def launch(out: Path) -> subprocess.CompletedProcess:
        config = {**experiment(out), "strategy": strategy}
        (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump(config))
        return subprocess.run(
            [sys.executable, "-m", "launchers.cli", "run", str(tmp_path / "fsdp2.yaml"), "--nproc-per-node", "2"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env=child_env(),
        )

    assert launch(tmp_path / "reference").returncode == 0
    reference = only_run(tmp_path / "reference")
    disk = small_disk(pages(reference) + RESERVE + pages(reference / "checkpoints/step-000012") // 2)
    done = launch(disk / "runs")
    assert done.returncode != 0
    # a rank that ran out says so in one line (one whose peer ended first may see a lost connection
    # instead; torchrun then prints its own ChildFailedError, as for any failed run)
    run_dir = only_run(disk / "runs")
    partial = run_dir / "checkpoints/step-000009.tmp"
    assert f"kanscale: train failed: DiskFull: the disk is full: writing checkpoint {partial}" in done.stderr, (
        done.stderr
    )
    assert "CheckpointException" not in done.stderr
    record = read_summary(run_dir)
    assert record.status == "failed" and record.error.type == "DiskFull" and "ENOSPC" in record.error.message
    assert str(partial) in record.error.message  # the checkpoint it was writing, whichever file failed
    assert not (run_dir / "checkpoints/step-000009.tmp").exists()
    kept = complete_checkpoints(run_dir)
    assert [c.path.name for c in kept] == ["step-000003", "step-000006"] and [verify(c) for c in kept] == [None, None]


def test_a_failed_launch_deletes_partial_saves_no_rank_holds_any_more(tmp_path):
    """A rank still writing its part when rank 0 recorded the failure (and deleted the partial
    save) creates it again: the launcher deletes it once every rank has ended, and leaves alone a
    run whose lock a live process holds."""
    from strategies.lifecycle.resume import discard_abandoned_saves
    from strategies.lifecycle.run_lock import RunLock

    ended, running = tmp_path / "ended", tmp_path / "running"
    for run_dir in (ended, running):
        (run_dir / "checkpoints/step-000009.tmp").mkdir(parents=True)
        (run_dir / "checkpoints/step-000009.tmp/rank1.pt").write_bytes(b"part")
        (run_dir / "checkpoints/step-000006").mkdir()
    held = RunLock.acquire(running)
    try:
        discard_abandoned_saves(tmp_path)
    finally:
        held.release()
    assert not (ended / "checkpoints/step-000009.tmp").exists() and (ended / "checkpoints/step-000006").is_dir()
    assert (running / "checkpoints/step-000009.tmp/rank1.pt").exists()


@pytest.mark.slow  # a sweep of three points on a disk too small for any
def test_a_full_disk_is_named_on_every_sweep_point_it_stops(tmp_path, small_disk):
    """The first point fills the disk with its checkpoint; the next ones find it full when they
    take their run's lock or write their output: each point's reason names the full disk."""
    disk = small_disk(200 * 1024)
    study = tmp_path / "study.yaml"
    sets = {"model.widths": [2, 2048, 1], "model.grid": 3, "training.steps": 12, "training.warmup_steps": 1}
    sets |= {"training.checkpoint_every": 3, "training.micro_batch": 32, "measurement.baseline_steps": 1}
    sets |= {"task.n_train": 256, "task.n_test": 64}
    study.write_text(
        yaml.safe_dump(
            {
                "study": "full_disk",
                "preset": "cpu",
                "experiment": str(ROOT / "configs/experiments/quickstart.yaml"),
                "set": sets,
                "matrix": {"strategy": ["single"], "topology": ["1x1"], "training.lr": [0.01, 0.02, 0.03]},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.cli", "sweep", str(study), "--out", str(disk / "runs")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=600,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if line.startswith("  failed: ")]
    assert len(lines) == 3, proc.stderr[-3000:]
    for line in lines:
        assert "DiskFull: the disk is full: writing " in line, line
