"""How a run ends on this rank: the trained model's test metrics, or a failure reported and
written into the run record (strategies/lifecycle/failures.py decides whose failure it was)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from analysis.records.run_files import RunWriter
from analysis.records.schema import BatchInfo, RunError, RunRecord
from kan_models.tasks import TaskConfig, TaskData
from strategies.lifecycle.checkpoint import discard_partial_saves
from strategies.lifecycle.disk import free_space
from strategies.lifecycle.failures import STOPPED, FailureReport, record_failure, reporting_failure, reports_dir
from strategies.loop.step_log import StepLog
from strategies.measure.record import now_iso
from strategies.runtime.distributed import DistEnv
from strategies.runtime.mesh import RunMesh
from strategies.step.engine import Engine


def evaluate(
    engine: Engine, env: DistEnv, mesh: RunMesh, data: TaskData, task: TaskConfig, micro_batch: int
) -> dict[str, float]:
    """The task's test metrics of the trained model, each data-parallel rank evaluating a
    shard. Every rank runs the same number of forward passes, which sharded strategies need."""
    n_test = data.x_test.shape[0]
    shard = torch.arange(n_test).tensor_split(mesh.dp_size)[mesh.dp_rank]
    chunk = max(micro_batch, 1024)
    n_chunks = max(1, math.ceil(math.ceil(n_test / mesh.dp_size) / chunk))
    sums = engine.evaluate(((data.x_test[i], data.y_test[i]) for i in shard.tensor_split(n_chunks)), task.metric_sums)
    # The statistics may be of any shape (one per output): summed over ranks as one tensor.
    names = sorted(sums)
    parts = [sums[n].double().reshape(-1) for n in names]
    totals = (env.all_reduce(torch.cat(parts), "sum") / mesh.ranks_per_replica).cpu()
    return task.metrics(dict(zip(names, totals.split([len(p) for p in parts]), strict=True)), n_test)


def write_failure(
    exc: BaseException,
    record: RunRecord,
    env: DistEnv,
    run_dir: Path,
    attempt: int,
    log: StepLog,
    steps_done: int,
    batch_at: Callable[[int], BatchInfo],
) -> RunRecord:
    """Report this rank's failure and rewrite the record from this attempt's reports so far (any
    rank may be the last one able to), then write the completed steps not yet written; returns
    the record as last written. Ctrl-C, or a SIGTERM no rank's failure preceded, leaves the run
    ``incomplete``: stopped, not failed."""
    with reporting_failure():
        free_space(run_dir)  # on a full disk, the room for the report and the record
        report = FailureReport(
            rank=env.rank,
            step=steps_done,
            type=type(exc).__name__,
            message=str(exc) or type(exc).__name__,
            time=time.time(),
        )

        def write(error: RunError) -> None:
            nonlocal record
            status = "incomplete" if isinstance(exc, KeyboardInterrupt) or error.type == STOPPED else "failed"
            record = record.model_copy(
                update={"status": status, "error": error, "finished_at": now_iso(), "batch": batch_at(error.step or 0)}
            )
            (log.writer or RunWriter(run_dir)).write_summary(record)

        record_failure(
            reports_dir(run_dir, attempt),
            report,
            env.world_size,
            write,
            make_room=lambda: discard_partial_saves(run_dir),
        )
        # The steps after the record: the reserve holds room for the record, whose size is
        # bounded; how many steps are not yet written is not.
        if log.writer is not None:
            with contextlib.suppress(OSError):  # a full disk: they do not fit (append_steps leaves no torn line)
                log.write(steps_done)
    return record
