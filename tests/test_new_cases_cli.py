"""Bad input at the command line (issue 28, the 30 new cases 6, 21, 23, 28 and 30): an export
never writes into the checkpoint or run it reads; analyze says which report directory it cannot
write and names --out; `kanscale run` refuses, before launch, a config the ranks cannot read again
(a pipe); one sweep at a time owns an output directory, and a point's run is its own; a DeepSpeed
NVMe offload without a path, or without the async_io op, is refused before launch. Real runs,
real files, real pipes and locks."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from launchers.cli import main
from strategies.distributed import DistEnv
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from tests.helpers.launch import child_env
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"


def refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------- case 23: export


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real one-process run with a checkpoint at step 4."""
    out = tmp_path_factory.mktemp("trained")
    cfg = {
        "name": "cli_cases",
        "model": {"family": "bspline", "widths": [2, 4, 1], "grid": 3, "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 128, "n_test": 32},
        "training": {"seed": 1, "micro_batch": 32, "steps": 4, "warmup_steps": 1, "checkpoint_every": 4},
        "strategy": {"name": "single"},
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }
    trainer = Trainer(parse_experiment(cfg), DistEnv(), show_progress=False)
    trainer.run()
    return trainer.run_dir


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / trained.name))


def test_export_refuses_an_out_inside_the_checkpoint_or_the_run_it_reads(run_dir, tmp_path, capsys):
    checkpoint = run_dir / "checkpoints/step-000004"
    state = (checkpoint / "state.pt").read_bytes()
    err = refused(["export", str(checkpoint), "--out", str(checkpoint / "state.pt")], capsys)
    assert f"--out: {checkpoint / 'state.pt'} lies inside the run directory being exported ({run_dir})" in err
    assert f"write the export outside it, e.g. --out {run_dir.parent / (run_dir.name + '.pt')}" in err
    refused(["export", str(run_dir), "--out", str(run_dir / "model.pt")], capsys)
    (tmp_path / "link").symlink_to(run_dir)  # the same run, reached through a symlink
    assert "lies inside the run directory" in refused(
        ["export", str(run_dir), "--out", str(tmp_path / "link/checkpoints/model.pt")], capsys
    )
    assert (checkpoint / "state.pt").read_bytes() == state and not (run_dir / "model.pt").exists()
    assert main(["export", str(tmp_path / "link"), "--out", str(tmp_path / "model.pt")]) == 0  # outside it: exported


def test_export_replaces_its_out_file_rather_than_writing_into_it(run_dir, tmp_path):
    """An --out hard-linked to the checkpoint's own file (which no path check can see) is
    replaced by a new file: the checkpoint keeps its bytes, and no temporary file is left."""
    state = run_dir / "checkpoints/step-000004/state.pt"
    before = state.read_bytes()
    out = tmp_path / "exports/model.pt"
    out.parent.mkdir()
    os.link(state, out)
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert state.read_bytes() == before and out.stat().st_ino != state.stat().st_ino
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.pt"]


# ------------------------------------------------------------------------------- case 30: analyze


@pytest.fixture
def read_only_runs(tmp_path) -> Path:
    """A directory of one run record that this user cannot write: chmod'ed, or for root (whom
    modes do not stop) a read-only bind mount of it."""
    runs = tmp_path / "runs"
    write_record(runs, make_record("r1"))
    if os.geteuid() != 0:
        for path in (runs / "r1", runs):
            path.chmod(0o555)
        yield runs
        for path in (runs, runs / "r1"):
            path.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("a read-only directory for root is a read-only bind mount, and there is no mount command")
    done = subprocess.run(["mount", "--bind", str(runs), str(runs)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here: {done.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(runs)], check=True, capture_output=True)
        yield runs
    finally:
        subprocess.run(["umount", str(runs)], capture_output=True)


def test_analyze_of_a_read_only_directory_names_the_report_directory_and_out(read_only_runs, tmp_path, capsys):
    err = refused(["analyze", str(read_only_runs)], capsys)
    assert f"--out (not given: DIR/report): {read_only_runs / 'report'} cannot be written: {read_only_runs}" in err
    assert "read-only" in err and "--out REPORT_DIR" in err
    assert main(["analyze", str(read_only_runs), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report/report.html").is_file()


# ------------------------------------------------------------------------------- case 6: pipes


def pipe_of(text: str) -> str:
    """/dev/fd/N of a pipe holding ``text``, as bash's <(...) gives (this process's only)."""
    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    return f"/dev/fd/{read}"


def test_run_refuses_a_config_the_ranks_cannot_read_again(tmp_path, capsys):
    piped = pipe_of(QUICKSTART.read_text())
    err = refused(["run", piped, "--strategy", "ddp", "--nproc-per-node", "2", "--dry-run"], capsys)
    assert f"config: {piped} is not a regular file" in err and "write it to a file first" in err
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)  # no writer: reading it would block, so it must be refused unread
    err = refused(
        ["run", str(QUICKSTART), "--deepspeed-config", str(fifo), "--nproc-per-node", "2", "--dry-run"], capsys
    )
    assert f"--deepspeed-config: {fifo} is not a regular file" in err
    err = refused(
        ["run", str(QUICKSTART), "--strategy", "accelerate", "--accelerate-config", str(fifo), "--dry-run"], capsys
    )
    assert f"--accelerate-config: {fifo} is not a regular file" in err


def test_train_in_one_process_still_reads_a_pipe(tmp_path, capsys):
    piped = pipe_of(QUICKSTART.read_text())
    assert (
        main(
            [
                "train",
                piped,
                "--set",
                "training.steps=6",
                "--set",
                "training.epochs=null",
                "--set",
                "measurement.baseline_steps=1",
                "--no-progress",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert len(list(tmp_path.glob("*/summary.json"))) == 1


# ------------------------------------------------------------------------------- case 28: sweeps


def write_study(tmp_path: Path) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "study": "owned",
                "experiment": str(QUICKSTART),
                "set": {
                    "training.steps": 6,
                    "training.epochs": None,
                    "training.micro_batch": 64,
                    "measurement.baseline_steps": 1,
                },
                "matrix": {"strategy": ["single"], "topology": ["1x1"], "training.lr": [0.01, 0.02]},
            }
        )
    )
    return path


def test_a_second_sweep_on_an_output_directory_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    from launchers.studies.sweep import SweepLock

    out = tmp_path / "runs"
    held = SweepLock.acquire(out)  # another sweep's hold (flock: another open file, as another process has)
    try:
        err = refused(["sweep", str(write_study(tmp_path)), "--out", str(out)], capsys)
    finally:
        held.release()
    assert f"{out} is in use by another sweep (pid {os.getpid()} on " in err and "started 20" in err
    assert "or give another --out" in err
    assert sorted(p.name for p in out.iterdir()) == [".sweep.lock"]  # nothing run, logged or set aside


def test_a_points_run_is_the_record_of_its_own_experiment_not_the_first_new_one(tmp_path):
    from launchers.launch.request import RunRequest
    from launchers.studies.study import Point
    from launchers.studies.sweep import outcome, run_key

    out = tmp_path / "runs"
    # a run of another experiment that appeared while the point ran, first by name, and the point's own
    write_record(out, make_record("a-foreign").model_copy(update={"config_digest": "f" * 16}))
    write_record(out, make_record("b-mine").model_copy(update={"config_digest": "m" * 16}))
    point = Point(axes={}, strategy="single", nodes=1, procs_per_node=1, overrides=[])
    result = outcome(
        point,
        run_key("m" * 16, 1, 1),
        out,
        RunRequest(config=str(QUICKSTART), out=str(out)),
        out / "point.log",
        set(),
        time.monotonic(),
        code=0,
    )
    assert (result.status, result.run_id) == ("ok", "b-mine")


@pytest.mark.slow  # ~15-25 s: two real sweeps, one of them a real run of two points
def test_two_sweeps_started_together_one_runs_every_point_the_other_is_refused(tmp_path):
    study, out = write_study(tmp_path), tmp_path / "runs"
    command = [sys.executable, "-m", "launchers.cli", "sweep", str(study), "--out", str(out)]
    first = subprocess.Popen(
        command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)
    second = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    first_out, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and f"{out} is in use by another sweep (pid {first.pid} on " in second.stderr
    entries = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    runs = sorted(p.parent.name for p in out.glob("*/summary.json"))
    assert len(entries) == 2 and sorted(e["run_id"] for e in entries) == runs  # one run per point, each its own


# ------------------------------------------------------------------------------- case 21: NVMe offload


def test_nvme_offload_without_a_path_or_the_async_io_op_is_refused_before_launch(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    from strategies.backends.deepspeed import accelerator_env

    # whether this machine has the op, asked of DeepSpeed itself meanwhile (an import of its own: ~2 s)
    probe = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from deepspeed.ops.op_builder import AsyncIOBuilder; "
            "sys.exit(0 if AsyncIOBuilder().is_compatible(verbose=False) else 3)",
        ],
        env={**os.environ, **accelerator_env("cuda" if torch.cuda.is_available() else "cpu")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    native = tmp_path / "ds_nvme.json"
    offload = {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
    native.write_text(json.dumps({"zero_optimization": offload}))
    run = [
        "run",
        "quickstart",
        "--deepspeed-config",
        str(native),
        "--launcher",
        "deepspeed",
        "--nproc-per-node",
        "2",
        "--dry-run",
    ]
    err = refused(run, capsys)
    for block in ("offload_optimizer", "offload_param"):
        assert (
            f'zero_optimization.{block}.device is "nvme" but zero_optimization.{block}.nvme_path is not set' in err
            and f"give zero_optimization.{block}.nvme_path, a directory on a local NVMe drive" in err
        )
    for block in ("offload_optimizer", "offload_param"):
        offload[block]["nvme_path"] = str(tmp_path / "swap")
    native.write_text(json.dumps({"zero_optimization": offload}))
    if probe.wait(timeout=300) == 0:  # this machine has libaio: the config is accepted
        assert main(run) == 0
    else:
        err = refused(run, capsys)
        assert "DeepSpeed's async_io op, which swaps to NVMe, is not available on this machine" in err
        assert "zero_optimization.offload_optimizer.device and zero_optimization.offload_param.device" in err
