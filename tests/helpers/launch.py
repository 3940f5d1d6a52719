"""Start real runs from tests, the way users do: multi-process launches, and the one-process
reference in the test's own process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from strategies.loop.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env(**extra_env))
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


class JobResults(dict):
    """A job pool's results by job id. Reading a job that raised without being asked to (no
    ``fault`` in its config), or that has no result because the pool died first, fails with that
    job's own error: only the tests that read a failed job fail, never the pool's other users."""

    def __init__(self, results: dict, jobs: list[dict], pool_failure: str | None) -> None:
        super().__init__(results)
        self.faulty = {job["id"] for job in jobs if "fault" in job.get("config", {})}
        self.pool_failure = pool_failure

    def __getitem__(self, job_id: str) -> dict:
        if job_id not in self:
            raise AssertionError(f"job {job_id} has no result: {self.pool_failure or 'it was not in the pool'}")
        result = super().__getitem__(job_id)
        if result.get("status") == "raised" and job_id not in self.faulty:
            raise AssertionError(f"job {job_id} raised {result['error']}")
        return result


def run_jobs(jobs: list[dict], tmp_path: Path, nproc: int = 2, nnodes: int = 1) -> JobResults:
    """Run experiments in one torchrun launch of ``nproc`` ranks per node; return the worker's
    results, those it wrote before it failed included. ``nnodes`` > 1: one torchrun per "node",
    all on this machine, meeting at node 0's address as on a cluster, so every rank sees the
    node layout (LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE) a real multi-node launch gives it."""
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    worker = [str(ROOT / "tests/helpers/dist_worker.py"), str(jobs_file), str(results_file)]
    try:
        if nnodes == 1:
            run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *worker],
                timeout=900,
            )
        else:
            run_nodes(nnodes, nproc, worker)
        failure = None
    except (AssertionError, subprocess.TimeoutExpired) as err:
        failure = f"the pool stopped before it: {err}"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    return JobResults(results, jobs, failure)


def free_port() -> int:
    """A port no process here listens on now: a launch planned on the default port (29500) would
    meet the real launches of tests running beside it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(nnodes: int, nproc: int, worker: list[str], timeout: float = 900) -> None:
    """One torchrun per node, started together; each node's output is kept for the error."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--node_rank={rank}",
                f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                *worker,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        for rank in range(nnodes)
    ]
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    failed = [(rank, node.returncode) for rank, node in enumerate(nodes) if node.returncode]
    if failed:
        raise AssertionError(
            "; ".join(f"node {rank} exited {code}" for rank, code in failed)
            + "\n"
            + "\n".join(f"--- node {rank}\n{out[-4000:]}" for rank, out in enumerate(outputs))
        )


def two_agent_commbench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real commbench over two launcher agents, run once per test session and shared by
    tests/test_commbench.py and tests/test_projection.py."""
    out = tmp_path_factory.getbasetemp() / "commbench-2x1" / "bench.json"
    if not out.exists():
        run(
            [
                sys.executable,
                "-m",
                "launchers.cli",
                "commbench",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--max-bytes",
                "16384",
                "--iters",
                "5",
                "--warmup",
                "2",
                "--out",
                str(out),
            ],
            timeout=240,
        )
    return out


def run_here(config: dict, resume: Path | None = None) -> "Trainer":
    """The experiment ``config`` trained in this process (the one-process reference strategies are
    compared with), resuming the run directory ``resume`` if given; its Trainer, after the run."""
    from strategies.experiment import parse_experiment
    from strategies.loop.trainer import Trainer
    from strategies.runtime.distributed import DistEnv

    trainer = Trainer(parse_experiment(config), DistEnv(), show_progress=False, resume=resume)
    trainer.run()
    return trainer
