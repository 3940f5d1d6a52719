"""Sweeps interrupted for real: a point that died before its first checkpoint is rerun and its stale
run set aside where `kanscale analyze` does not count it; a SIGTERM to the sweep logs the running
point as stopped, leaves none of its processes behind, exits 143, and --resume finishes the study."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from analysis.records.load import load_runs
from analysis.records.run_files import read_steps, read_summary
from launchers.cli import main
from strategies.lifecycle.checkpoint import latest_checkpoint
from strategies.lifecycle.run_lock import RunLock
from tests.helpers.launch import child_env
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]
# A model factory that makes every rank ignore SIGTERM (the sweep's own validation, which builds
# the model too, has no LOCAL_RANK): a rank stuck where the launcher's signal does not reach it.
DEAF_FACTORY = """import os, signal
from torch import nn

def build():
    if "LOCAL_RANK" in os.environ:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return nn.Linear(2, 1)
"""


def write_study(tmp_path: Path, strategy: str, topology: str, axes: dict | None = None, **settings) -> Path:
    path = tmp_path / "study.yaml"  # rewritten in place: with a fault, then without (not part of the point)
    path.write_text(
        yaml.safe_dump(
            {
                "study": "interrupted",
                "experiment": str(ROOT / "configs/experiments/quickstart.yaml"),
                "set": {
                    "training.steps": 6,
                    "training.micro_batch": 64,
                    "training.log_every": 1,
                    "measurement.baseline_steps": 1,
                    **settings,
                },
                "matrix": {"strategy": [strategy], "topology": [topology], **(axes or {})},
            }
        )
    )
    return path


def sweep_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two runs of a one-process point
def test_a_point_that_died_before_its_first_checkpoint_is_rerun_and_counted_once(tmp_path, capsys):
    out = tmp_path / "runs"
    # The process ends at step 3 with no cleanup, as a kill or the OOM killer ends it; no checkpoint yet.
    died = write_study(tmp_path, "single", "1x1", **{"fault.rank": 0, "fault.step": 3, "fault.kind": "exit"})
    assert main(["sweep", str(died), "--out", str(out)]) == 1
    (stale,) = [summary.parent for summary in out.glob("*/summary.json")]
    assert read_summary(stale).status == "incomplete" and latest_checkpoint(stale) is None
    # All it wrote but its lock, which names its holder: the sweep that archives it, then.
    written = {
        p.relative_to(out).as_posix(): p.read_bytes() for p in stale.rglob("*") if p.is_file() and p.name != ".lock"
    }
    assert f"{stale.name}/summary.json" in written
    assert "sweep: 1 failed" in capsys.readouterr().out

    assert main(["sweep", str(write_study(tmp_path, "single", "1x1")), "--out", str(out), "--resume"]) == 0
    archive = out / "stale" / f"{stale.name}.tar"
    assert f"the stale run is set aside as {archive}" in capsys.readouterr().err
    assert not stale.exists()
    with tarfile.open(archive) as tar:  # what the stale run wrote, all of it, byte for byte
        assert {
            m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile() and m.name in written
        } == written
    assert [(e["status"], e["set_aside"]) for e in sweep_log(out)] == [("failed", []), ("ok", [str(archive)])]

    runs, problems = load_runs(out)  # what kanscale analyze reads: the rerun alone, nothing "not analysed"
    assert problems == [] and list(runs["status"]) == ["ok"] and list(runs["run_id"]) == [sweep_log(out)[-1]["run_id"]]


def test_a_stale_run_is_archived_whole_where_analyze_does_not_count_it_and_a_live_one_is_left(tmp_path, capsys):
    from launchers.studies.leftovers import set_aside_runs
    from launchers.studies.point import earlier_runs

    out = tmp_path / "runs"
    write_record(out, make_record("done"))
    stale = write_record(out, make_record("dead").model_copy(update={"status": "incomplete"}))
    (stale / "steps.jsonl").write_text('{"step": 1}\n')
    (stale / "failures/attempt-1").mkdir(parents=True)
    (stale / "failures/attempt-1/rank0.json").write_text('{"rank": 0}')
    (stale / "checkpoints/step-000004.tmp").mkdir(parents=True)  # a save cut short: never a checkpoint
    (stale / "checkpoints/step-000004.tmp/state.pt").write_bytes(b"half")
    live = write_record(out, make_record("live").model_copy(update={"status": "incomplete"}))
    held = RunLock.acquire(live)  # a run still going (another sweep's, a job's)
    try:
        earlier = earlier_runs(out)
        assert sorted(r.run_id for runs in earlier.stale.values() for r in runs) == ["dead", "live"]
        assert set_aside_runs(out, [stale, live], "the-point") == [str(out / "stale/dead.tar")]
    finally:
        held.release()
    err = capsys.readouterr().err
    assert f"{live} left in place: {live} is in use by another run" in err and "set aside as" in err
    assert not stale.exists() and (live / "summary.json").is_file()
    with tarfile.open(out / "stale/dead.tar") as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
        assert {"dead/summary.json", "dead/steps.jsonl", "dead/failures/attempt-1/rank0.json"} <= names
        assert not any(".tmp" in name for name in names)
    runs, problems = load_runs(out)
    assert problems == [] and sorted(runs["run_id"]) == ["done", "live"]
    # docs/studies.md: `tar -xf OUT/stale/<run_id>.tar` gives the run back as it was
    subprocess.run(["tar", "-xf", str(out / "stale/dead.tar")], cwd=tmp_path, check=True)
    assert read_summary(tmp_path / "dead").status == "incomplete"
    assert (tmp_path / "dead/failures/attempt-1/rank0.json").read_text() == '{"rank": 0}'


def test_a_launch_leaves_no_orphan_behind(capfd):
    """A process the launch started in a session of its own, whose parent has ended, is ended too."""
    from launchers.studies.leftovers import no_strays

    with no_strays("the-point"):
        orphan = int(
            subprocess.run(
                ["sh", "-c", "setsid sleep 60 > /dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
            ).stdout
        )
        assert alive(orphan)
    assert not alive(orphan) and "the-point: killed 1 process(es) its launcher left running" in capfd.readouterr().err


def descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.fixture
def leftovers():
    """The processes a test started: any still running when it has ended (its asserts made) are killed."""
    pids: set[int] = set()
    yield pids
    for pid in pids.union(*(descendants(p) for p in pids)):
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stop_sweep_during_a_point(
    study: Path, out: Path, ready, leftovers: set[int]
) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Start `kanscale sweep` on its own, SIGTERM it (only it, as `kill PID` does) once ``ready()``,
    and wait for it; its exit and the processes it had started then (also added to ``leftovers``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launchers.cli", "sweep", str(study), "--out", str(out)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    leftovers.add(proc.pid)
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    started = descendants(proc.pid)
    leftovers.update(started)
    assert proc.poll() is None and len(started) >= 3, "the point's launcher and its 2 ranks should be running"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=90)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), started


@pytest.mark.slow  # a 2-rank point, stopped, then resumed
def test_a_sigterm_to_the_sweep_logs_the_point_stopped_leaves_no_process_and_resume_finishes(tmp_path, leftovers):
    out = tmp_path / "runs"
    # The ranks wait at step 4, after the checkpoint of step 2, for the signal.
    hung = write_study(
        tmp_path,
        "ddp",
        "1x2",
        **{"training.checkpoint_every": 2, "fault.rank": "all", "fault.step": 4, "fault.kind": "hang"},
    )
    done, started = stop_sweep_during_a_point(hung, out, lambda: any(out.glob("*/checkpoints/step-000002")), leftovers)
    assert [pid for pid in started if alive(pid)] == [], done.stderr[-3000:]
    assert done.returncode == 143, done.stderr[-3000:]
    assert "stopped by SIGTERM during strategy=ddp_topology=1x2" in done.stderr and "--resume" in done.stderr
    (run_dir,) = [summary.parent for summary in out.glob("*/summary.json")]
    (entry,) = sweep_log(out)
    assert (entry["status"], entry["signal"], entry["run_id"]) == ("stopped", "SIGTERM", run_dir.name)
    record = read_summary(run_dir)
    assert record.status == "incomplete" and record.error.type == "Terminated"  # the ranks recorded the stop

    assert (
        main(
            [
                "sweep",
                str(write_study(tmp_path, "ddp", "1x2", **{"training.checkpoint_every": 2})),
                "--out",
                str(out),
                "--resume",
            ]
        )
        == 0
    )
    (resumed,) = [summary.parent for summary in out.glob("*/summary.json")]
    record = read_summary(resumed)
    assert resumed == run_dir and record.status == "ok" and record.resumed_at_steps == [2]
    assert len(read_steps(resumed)) == 6 and [e["status"] for e in sweep_log(out)] == ["stopped", "ok"]


@pytest.mark.slow  # the launcher's 10 s grace runs out
def test_ranks_that_ignore_sigterm_are_not_left_running_when_the_sweep_is_stopped(tmp_path, leftovers):
    """torchrun gives its ranks 30 s to end and the sweep gives torchrun 10 s: ranks deaf to SIGTERM
    outlive a killed torchrun, in sessions of their own. The sweep ends them all the same."""
    factory = tmp_path / "deaf.py"
    factory.write_text(DEAF_FACTORY)
    out = tmp_path / "runs"
    study = write_study(
        tmp_path,
        "ddp",
        "1x2",
        **{
            "model": {"family": "custom", "widths": [2, 1], "factory": f"{factory}:build"},
            "fault.rank": "all",
            "fault.step": 3,
            "fault.kind": "hang",
        },
    )
    # The record is written after a collective that follows every rank's model build: both are deaf by then.
    done, started = stop_sweep_during_a_point(study, out, lambda: any(out.glob("*/summary.json")), leftovers)
    assert [pid for pid in started if alive(pid)] == [], done.stderr[-3000:]
    assert done.returncode == 143 and "killed 2 process(es) its launcher left running" in done.stderr
    (entry,) = sweep_log(out)
    assert (entry["status"], entry["signal"]) == ("stopped", "SIGTERM")


@pytest.mark.slow  # two one-process points, each stopped
def test_a_point_whose_own_process_is_stopped_is_logged_stopped_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "runs"
    study = write_study(
        tmp_path,
        "single",
        "1x1",
        axes={"training.seed": [0, 1]},
        **{"fault.rank": 0, "fault.step": 3, "fault.kind": "hang"},
    )
    problems: list[str] = []

    def stop_each_point() -> None:  # a user's `kill` of each point's process, not of the sweep (this process)
        seen: set[Path] = set()
        for _ in range(2):
            deadline = time.monotonic() + 120
            while not (new := {p.parent for p in out.glob("*/summary.json")} - seen) and time.monotonic() < deadline:
                time.sleep(0.2)
            seen |= new
            points = descendants(os.getpid())
            if len(new) != 1 or len(points) != 1:
                problems.append(f"expected one new run and one process, got {new} and {points}")
            for pid in points:
                os.kill(pid, signal.SIGTERM)

    stopper = threading.Thread(target=stop_each_point)
    stopper.start()
    code = main(["sweep", str(study), "--out", str(out)])
    stopper.join()
    assert problems == [] and code == 1
    log = sweep_log(out)
    assert [(e["status"], e["signal"]) for e in log] == [("stopped", "SIGTERM")] * 2  # the sweep went on to the second
    assert all(
        "stopped by a signal" in e["detail"] and read_summary(out / e["run_id"]).status == "incomplete" for e in log
    )
