"""Start real multi-process runs from tests, the way users do."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env(**extra_env))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def run_jobs(jobs: list[dict], tmp_path: Path, nproc: int = 2) -> dict:
    """Run experiments in one torchrun launch of ``nproc`` ranks; return the worker's results."""
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         str(ROOT / "tests/helpers/dist_worker.py"), str(jobs_file), str(results_file)], timeout=900)
    return json.loads(results_file.read_text())
