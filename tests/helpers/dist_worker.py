"""Runs a list of experiments inside one real process group (started by torchrun) and writes
what the tests compare: per-step losses, model-state bytes, timings, the distributed type, and
whether every rank ends with the same model.

A job may ask for ``comm_delay_s``: its DDP gradient all-reduce then waits that long first (a
DDP communication hook), a known amount of extra communication time for the measurement to find.
A job with ``"resume": true`` continues the newest unfinished run of its experiment; a job that
raises, on every rank (fault injection, a refused config, a backend that cannot start), is
recorded with its error and the worker goes on to the next: one job's failure is that job's
alone. The results file is rewritten after every job, so a worker that dies keeps what it had.
A job ``{"id": ..., "export": RUN_DIR_OF_JOB, "to": FILE}`` exports that job's checkpoint.

    torchrun --standalone --nproc_per_node 2 tests/helpers/dist_worker.py JOBS.json RESULTS.json
"""

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from strategies.backends.ddp import DDPConfig
from strategies.experiment import parse_experiment
from strategies.lifecycle.export import export
from strategies.loop.trainer import Trainer, find_resumable
from strategies.runtime.distributed import DistEnv


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # any dtype, bf16 too
    return h.hexdigest()


@contextlib.contextmanager
def delayed_allreduce(delay_s: float):
    """Make DDP's gradient all-reduce take ``delay_s`` longer, without changing its result."""

    def hook(state, bucket):
        time.sleep(delay_s)
        tensor = bucket.buffer()
        return (
            dist.all_reduce(tensor.div_(dist.get_world_size()), async_op=True).get_future().then(lambda f: f.value()[0])
        )

    original = DDPConfig.apply

    def apply(self, model, training, env):
        engine = original(self, model, training, env)
        engine.model.register_comm_hook(None, hook)
        return engine

    DDPConfig.apply = apply
    try:
        yield
    finally:
        DDPConfig.apply = original


def main(jobs_path: str, results_path: str) -> None:
    # A rank the others gave up on is stopped by torchrun's SIGTERM: its stack, on stderr (which
    # the failing test shows), says where it was held.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    torch.set_num_threads(1)
    jobs = json.loads(Path(jobs_path).read_text())
    env = DistEnv.from_environ("cpu")
    env.init_process_group(timeout_s=60)
    results = {}
    run_dirs = {}
    for job in jobs:
        if "export" in job:
            if env.is_main:
                export(run_dirs[job["export"]], job["to"])
            env.barrier()
            continue
        trainer = None
        try:
            cfg = parse_experiment(job["config"])
            resume = find_resumable(cfg, env.world_size) if job.get("resume") else None
            trainer = Trainer(cfg, env, show_progress=False, resume=resume)
            run_dirs[job["id"]] = trainer.run_dir
            delay = job.get("comm_delay_s")
            with delayed_allreduce(delay) if delay else contextlib.nullcontext():
                record = trainer.run()
        except Exception as err:
            # every rank says it: only rank 0 writes the results, and another rank may raise alone
            print(f"[rank {env.rank}] job {job['id']} raised {type(err).__name__}: {err}", file=sys.stderr)
            results[job["id"]] = {
                "status": "raised",
                "error": f"{type(err).__name__}: {err}",
                "losses": [s.loss for s in trainer.combined] if trainer is not None else [],
            }
            write_results(env, results, results_path)
            continue
        digests = env.gather_strings(state_digest(trainer.engine.full_state_dict()))
        results[job["id"]] = {
            "losses": [s.loss for s in trainer.combined],
            "model_state": record.memory.model_state.model_dump(),
            "memory": record.memory.model_dump(),
            "flops": record.flops.model_dump() if record.flops else None,
            "precision": record.precision.model_dump(),
            "compile": record.compile.model_dump() if record.compile else None,
            "distributed_type": record.strategy.distributed_type,
            "ranks_identical": len(set(digests)) == 1,
            "status": record.status,
            "comm_overhead": record.comm_overhead,
            "timings": record.timings.model_dump(),
            "comm": record.comm.model_dump(),
            "test_metrics": record.test_metrics,
            "measurement": record.measurement.model_dump(),
            "resumed_at_steps": record.resumed_at_steps,
            "run_dir": str(trainer.run_dir),
            "mesh": record.topology.mesh,
            "comm_bytes": record.comm_bytes.model_dump() if record.comm_bytes else None,
            "label": record.strategy.label,
        }
        del trainer
        write_results(env, results, results_path)
    finish(env, results, results_path)


def write_results(env: DistEnv, results: dict, results_path: str) -> None:
    """Rank 0 replaces the results file with ``results`` (whole, never half-written)."""
    if env.is_main:
        with open(f"{results_path}.tmp", "w") as f:
            json.dump(results, f)
        os.replace(f"{results_path}.tmp", results_path)


def finish(env: DistEnv, results: dict, results_path: str) -> None:
    """Rank 0 writes ``results``; every rank leaves the process group, then the process, without
    destructors: tearing down gloo process groups can deadlock (see launchers/cli/common.py)."""
    write_results(env, results, results_path)
    env.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
