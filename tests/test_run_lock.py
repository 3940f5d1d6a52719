"""A run directory has one owner at a time: a second run is refused on every rank while the first
trains, a lock left by a killed run is taken over, and one still held for an owner that ended is
refused with how to find the holder. Across a run's attempts, each attempt's failure reports are
its own, and the steps completed before a failure or a stop are all written."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.records.run_files import read_steps, read_summary
from kanscale.errors import ConfigError
from strategies.lifecycle.checkpoint import complete_checkpoints
from strategies.lifecycle.failures import FailureReport
from strategies.lifecycle.run_lock import LOCK_FILE, RunLock
from tests.helpers.launch import ROOT, child_env

# The slow tier (make test-slow, run by .ci/run): kills, resumes and concurrent owners of real
# multi-process runs.
pytestmark = pytest.mark.slow

QUICKSTART = str(ROOT / "configs/experiments/quickstart.yaml")
TWO_RANKS = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
LONG = [
    "training.steps=100000",
    "training.micro_batch=64",
    "training.checkpoint_every=400",
    "training.log_every=200",
    "measurement.baseline_steps=1",
    "runtime.timeout_s=10",
]


def train_cmd(out: Path, *settings: str, resume: Path | None = None) -> list[str]:
    cmd = ["-m", "launchers.cli", "train", QUICKSTART, "--strategy", "ddp", "--out", str(out), "--no-progress"]
    cmd += [arg for s in (*LONG, *settings) for arg in ("--set", s)]
    return cmd + (["--resume", str(resume)] if resume else [])


def text_of(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def wait_for(condition, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.2)


def two_plain_ranks(cmd: list[str]) -> list[subprocess.CompletedProcess]:
    """Both ranks of a 2-rank launch, started by hand (no launcher stops one when the other exits):
    how each rank ends on its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, *cmd],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
            ),
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 60  # refusing takes seconds; a rank that is not refused trains on
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        p.kill()
    return [subprocess.CompletedProcess(p.args, p.wait(), *p.communicate()) for p in procs]


@pytest.fixture(scope="module")
def contested_run(tmp_path_factory):
    """A 2-rank DDP run through three attempts: 1 fails on rank 1 (step 411), 2 resumes from step
    400 and, while it trains, a second resume of the same run is tried; 2 is then stopped with
    SIGTERM like a user's kill; 3 resumes again and loses rank 0 (os._exit) two steps later."""
    out = tmp_path_factory.mktemp("contested")
    seen = {}
    first = subprocess.run(
        [*TWO_RANKS, *train_cmd(out, "fault.rank=1", "fault.step=411", "fault.kind=exception")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode != 0
    (run_dir,) = list(out.iterdir())
    seen["first"] = (read_summary(run_dir), read_steps(run_dir))
    lock = run_dir / LOCK_FILE
    seen["lock_after_first"] = text_of(lock)
    with open(out.parent / "second.log", "w") as log:
        second = subprocess.Popen(
            [*TWO_RANKS, *train_cmd(out, resume=run_dir)],
            cwd=ROOT,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: len(read_steps(run_dir)) >= 600)  # training, past its first write after the resume
            seen["owner"] = json.loads(text_of(lock) or "{}")
            written = len(read_steps(run_dir))
            seen["rival"] = two_plain_ranks(train_cmd(out, resume=run_dir))
            wait_for(lambda: len(read_steps(run_dir)) > written)  # the owner trains on past the rival's refusal
            second.send_signal(signal.SIGTERM)  # as a user kills the launcher they started
            assert second.wait(timeout=120) != 0
        finally:
            second.kill()
    seen["second"] = (read_summary(run_dir), read_steps(run_dir))
    seen["lock_after_second"] = text_of(lock)
    seen["attempts_after_second"] = sorted(p.name for p in (run_dir / "failures").iterdir())
    latest = complete_checkpoints(run_dir)[-1].step
    third = subprocess.run(
        [*TWO_RANKS, *train_cmd(out, "fault.rank=0", f"fault.step={latest + 3}", "fault.kind=exit", resume=run_dir)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert third.returncode != 0
    seen["third"] = (read_summary(run_dir), read_steps(run_dir), latest)
    return run_dir, seen


def test_every_step_completed_before_a_failure_is_written(contested_run):
    _, seen = contested_run
    record, steps = seen["first"]
    assert (record.status, record.error.type, record.error.rank, record.error.step) == (
        "failed",
        "RuntimeError",
        1,
        410,
    )
    assert [s.step for s in steps] == list(range(1, 411))  # the last write before the failure was at step 400


def test_a_second_run_is_refused_on_every_rank_while_the_first_owns_the_directory(contested_run):
    run_dir, seen = contested_run
    owner = seen["owner"]
    assert seen["lock_after_first"] == ""  # a run that ended, even failing, leaves no owner behind
    assert owner.get("host") == socket.gethostname()
    for rank in seen["rival"]:
        assert rank.returncode == 2, rank.stderr[-3000:]
        assert f"{run_dir} is in use by another run (pid {owner['pid']} on {owner['host']}" in rank.stderr
        assert "Traceback" not in rank.stderr
    record, steps = seen["second"]
    assert record.resumed_at_steps == [400]  # the rival neither resumed nor cut anything
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert seen["attempts_after_second"] == ["attempt-1", "attempt-2"]  # and reported nothing


def test_sigterm_of_a_healthy_run_is_recorded_as_a_stop_with_every_completed_step(contested_run):
    _run_dir, seen = contested_run
    record, steps = seen["second"]
    assert record.status == "incomplete" and record.error.type == "Terminated"
    assert "stopped by a signal" in record.error.message and "before any rank failed" in record.error.message
    assert [s.step for s in steps] == list(range(1, len(steps) + 1)) and len(steps) > 600
    # Not only up to the last write (every 200 steps): up to the last timing window (10 steps) that
    # every rank finished; the steps of the window in progress were never combined across ranks.
    assert 0 <= record.error.step - len(steps) <= 10  # 10: the rank had just finished a window the others had not
    assert seen["lock_after_second"] == ""


def test_an_earlier_attempts_failure_is_not_the_cause_of_a_later_one(contested_run):
    run_dir, seen = contested_run
    record, steps, latest = seen["third"]
    assert (record.status, record.error.type, record.error.rank, record.error.step) == (
        "failed",
        "RankLost",
        0,
        latest + 2,
    )
    assert record.resumed_at_steps == [400, latest]
    assert [s.step for s in steps] == list(range(1, latest + 1))  # rank 0, the writer, died before its next write
    reports = {
        p.relative_to(run_dir / "failures").as_posix(): json.loads(p.read_text())
        for p in sorted((run_dir / "failures").rglob("rank*.json"))
    }
    assert reports["attempt-1/rank1.json"]["type"] == "RuntimeError"  # kept, and not taken for attempt 3's cause
    # the stop: each rank got SIGTERM, or lost its peer to it first
    stop = {FailureReport(**reports[f"attempt-2/rank{r}.json"]).kind for r in range(2)}
    assert "terminated" in stop and stop <= {"terminated", "lost"}
    assert {r for r in reports if r.startswith("attempt-3/")} == {"attempt-3/rank1.json"}


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "launchers.cli",
        "train",
        QUICKSTART,
        "--out",
        str(tmp_path),
        "--no-progress",
        "--set",
        "training.steps=100000",
        "--set",
        "training.checkpoint_every=20",
        "--set",
        "training.micro_batch=64",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stderr=subprocess.DEVNULL)
    wait_for(lambda: any(complete_checkpoints(d) for d in tmp_path.iterdir()))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run_dir,) = list(tmp_path.iterdir())
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid  # the name is left behind, the flock is not
    latest = complete_checkpoints(run_dir)[-1].step
    resumed = subprocess.run(
        [
            *cmd,
            "--resume",
            str(run_dir),
            "--set",
            "fault.rank=all",
            "--set",
            f"fault.step={latest + 2}",
            "--set",
            "fault.kind=exception",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 1
    assert f"took over the lock of an earlier run that did not end cleanly (pid {proc.pid} on" in resumed.stderr
    record = read_summary(run_dir)
    assert record.resumed_at_steps == [latest] and record.error.type == "RuntimeError"


def test_a_lock_still_held_for_an_ended_owner_is_refused_with_how_to_find_the_holder(tmp_path, capsys):
    """The owner ended, but a process it forked inherited the lock and still holds it."""
    script = (
        "import os, sys, time\nfrom pathlib import Path\nfrom strategies.lifecycle.run_lock import RunLock\n"
        "lock = RunLock.acquire(Path(sys.argv[1]))\nchild = os.fork()\nif child == 0:\n"
        "    quiet = os.open(os.devnull, os.O_WRONLY)\n    os.dup2(quiet, 1)\n    os.dup2(quiet, 2)\n"
        "    time.sleep(120)\n    os._exit(0)\nprint(os.getpid(), child, flush=True)\nos._exit(0)\n"
    )
    owner = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    owner_pid, child_pid = map(int, owner.stdout.split())
    try:
        with pytest.raises(ConfigError) as refused:
            RunLock.acquire(tmp_path)
        assert f"on behalf of a run that has ended (pid {owner_pid} on {socket.gethostname()}" in str(refused.value)
        assert f"fuser -v {tmp_path / LOCK_FILE}" in str(refused.value)
    finally:
        os.kill(child_pid, signal.SIGKILL)

    def acquired() -> bool:
        try:
            RunLock.acquire(tmp_path).release()
        except ConfigError:
            return False  # the holder is still being killed
        return True

    wait_for(acquired, timeout=30)  # free again once the holder is gone
    assert f"took over the lock of an earlier run that did not end cleanly (pid {owner_pid}" in capsys.readouterr().err
