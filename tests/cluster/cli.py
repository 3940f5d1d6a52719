"""Running ``kanscale`` from the cluster tests, as a user would, and reading what it left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from analysis.records.run_files import read_summary
from analysis.records.schema import RunRecord
from tests.cluster.daemons import ROOT, search_path

# A few steps of the quickstart: seconds per rank once torch is imported.
SHORT = ["--set", "training.steps=10", "--set", "measurement.baseline_steps=2", "--set", "training.micro_batch=64"]
# The strategy each inner launcher naturally starts.
STRATEGY_FOR = {"torchrun": "ddp", "deepspeed": "zero2", "accelerate": "accelerate"}


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PATH=search_path())
    env.update(extra)
    return env


def kanscale(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``kanscale ARGS`` (this environment's, as a user would) and return what it did; on a
    timeout its whole process group is ended and the test fails with its output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launchers.cli", *args],
        cwd=cwd,
        env=env or cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"kanscale {' '.join(args)} still running after {timeout:.0f} s\n--- stdout\n{out[-3000:]}"
            f"\n--- stderr\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def explain(done: subprocess.CompletedProcess) -> str:
    return (
        f"{' '.join(map(str, done.args[3:]))} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-6000:]}"
    )


def submitted_job(done: subprocess.CompletedProcess) -> str:
    """The job id in sbatch's reply ("Submitted batch job ID"), which kanscale prints on stderr."""
    assert done.returncode == 0, explain(done)
    found = re.findall(r"Submitted batch job (\d+)", done.stderr)
    assert found, f"no 'Submitted batch job ID' on stderr\n{explain(done)}"
    return found[-1]


def job_logs(directory: Path, job_id: str) -> str:
    """The job's output files under ``directory`` (where kanscale points #SBATCH --output), for failure messages."""
    files = [p for p in Path(directory).rglob(f"*{job_id}*") if p.is_file() and p.suffix in (".out", ".err", ".log")]
    if not files:
        return f"(no output file of job {job_id} under {directory})"
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-6000:]}" for p in files)


def records(out: Path) -> list[RunRecord]:
    """Every run record under ``out`` (``OUT/<run_id>/summary.json``)."""
    return [read_summary(p) for p in sorted(Path(out).glob("*/summary.json"))]
