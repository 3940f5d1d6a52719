"""One attempt at a run: the directory it owns and, for a resume, what it continues from.

Rank 0 decides, before anything in the run directory changes: it takes the directory's lock
(strategies/lifecycle/run_lock.py) and, to resume, checks that the run is unfinished and the same
experiment and world size, reads its steps, and picks the newest checkpoint that verifies
(strategies/lifecycle/checkpoint.py), setting aside the corrupt ones it passed over. Every rank then gets
the same outcome by one broadcast, a refusal included, so all ranks go on or all refuse with the
same message; none waits in a collective for a rank that gave up. Having taken the directory,
rank 0 reserves the room a failure's record needs (strategies/lifecycle/disk.py); a disk without
that room is refused the same way. When the run ends, rank 0 deletes the reserve and what a save
that did not complete left, then lets the lock go.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.records.run_files import CONFIG_FILE, SUMMARY_FILE, RecordError, read_steps, read_summary
from analysis.records.schema import RunRecord, StepRecord
from kanscale import log
from kanscale.errors import ConfigError
from kanscale.files import read_mapping
from kanscale.identity import differences as config_differences
from kanscale.identity import identity
from strategies.experiment import ExperimentConfig
from strategies.lifecycle.checkpoint import (
    PARTIAL,
    Checkpoint,
    discard_partial_saves,
    latest_checkpoint,
    set_aside,
    usable_checkpoint,
)
from strategies.lifecycle.disk import disk_full, free_space, reserve_space
from strategies.lifecycle.run_lock import LOCK_FILE, RunLock
from strategies.native_training import with_native_training
from strategies.runtime.distributed import DistEnv

logger = log.get(__name__)


def find_resumable(cfg: ExperimentConfig, world_size: int) -> Path:
    """The newest unfinished run of this experiment in output.dir that has a complete checkpoint
    (a finished run, status ok, is never resumed)."""
    cfg = with_native_training(cfg)  # as the run recorded it: what its native file decided taken in
    candidates = []
    for summary in Path(cfg.output.dir).glob(f"*/{SUMMARY_FILE}"):
        try:
            record = read_summary(summary)
        except RecordError:
            continue  # an unreadable record is no run to continue; `kanscale analyze` reports it
        if (
            record.topology.world_size == world_size
            and record.status != "ok"
            and same_experiment(record, summary.parent, cfg)
            and latest_checkpoint(summary.parent) is not None
        ):
            candidates.append((record.started_at, summary.parent))
    if not candidates:
        raise ConfigError(
            f"--resume: no unfinished run of this experiment with a checkpoint under {cfg.output.dir} "
            f"(at world size {world_size}); give the run directory, or set training.checkpoint_every"
        )
    return max(candidates)[1]


def same_experiment(record: RunRecord, run_dir: Path, cfg: ExperimentConfig) -> bool:
    """Whether the run in ``run_dir`` is of the experiment ``cfg``: equal digests, or, for a run
    whose digest an earlier kanscale took over more fields (output.dir), an equal config.yaml."""
    return record.config_digest == cfg.digest() or differences(run_dir, cfg) == []


def differences(run_dir: Path, cfg: ExperimentConfig) -> list[str] | None:
    """Each field in which the experiment of the run in ``run_dir`` (its config.yaml) and ``cfg``
    differ, with both values; None where the run has no readable config.yaml."""
    try:
        theirs = identity(read_mapping(run_dir / CONFIG_FILE, "--resume"))
    except (ConfigError, OSError):
        return None
    return [
        f"{key}: {run!r} in the run, {now!r} now"
        for key, (run, now) in config_differences(theirs, cfg.identity()).items()
    ]


@dataclass
class Attempt:
    run_dir: Path
    number: int  # the run's n-th start: 1, then one more per resume (its failure reports: failures/attempt-<n>)
    lock: RunLock | None = None  # rank 0's
    previous: RunRecord | None = None  # the record of the run resumed
    checkpoint: Checkpoint | None = None
    steps: list[StepRecord] = field(default_factory=list)  # the steps before the checkpoint, kept

    def release(self) -> None:
        """Rank 0, once the record is final: clean up and let the directory go."""
        if self.lock is not None:
            discard_partial_saves(self.run_dir)
            free_space(self.run_dir)
            self.lock.release()


def _take(run_dir: Path, world_size: int) -> RunLock:
    """Rank 0: lock a new run's directory and reserve the room to record a failure."""
    try:
        lock = RunLock.acquire(run_dir)
    except OSError as err:  # a disk too full even for the lock's few bytes: named as the cause
        full = disk_full(err, Path(run_dir) / LOCK_FILE, "the run's lock")
        if full is err:
            raise
        raise full from err
    try:
        reserve_space(run_dir, world_size)
    except BaseException:
        lock.release()
        raise
    return lock


def _decide_resume(cfg: ExperimentConfig, world_size: int, run_dir: Path) -> tuple[RunLock, dict[str, Any]]:
    """Rank 0: lock the run and check it can be resumed; what every rank needs, as plain data."""
    if not (run_dir / SUMMARY_FILE).is_file():
        raise ConfigError(
            f"--resume {run_dir}: not a run directory (no {SUMMARY_FILE}); give a directory a run wrote "
            f"under output.dir, or --resume alone for the newest unfinished run"
        )
    lock, reserved = RunLock.acquire(run_dir), False
    try:
        previous = read_summary(run_dir)  # under the lock: the run cannot finish or resume meanwhile
        if previous.status == "ok":
            raise ConfigError(
                f"--resume: {run_dir} finished (status ok); a finished run is not resumed: start a new "
                "one without --resume (a sweep with --resume skips finished points by itself)"
            )
        if previous.topology.world_size != world_size:
            raise ConfigError(
                f"--resume: {run_dir} ran at world size {previous.topology.world_size}, this launch has "
                f"{world_size} ranks; resume with the launch it was started with"
            )
        if not same_experiment(previous, run_dir, cfg):
            differ = differences(run_dir, cfg)
            raise ConfigError(
                f"--resume: {run_dir} is a different experiment"
                + (f" ({'; '.join(differ[:6])}{'; ...' if len(differ) > 6 else ''})" if differ else "")
                + "; resume with the config it was started with"
            )
        steps = read_steps(run_dir)
        checkpoint, passed_over = usable_checkpoint(run_dir, len(steps))
        reasons = "; ".join(f"{p.path.name}: {p.why}" for p in passed_over)
        if checkpoint is None:
            raise ConfigError(
                f"--resume: {run_dir} has no usable checkpoint to resume from"
                + (f" ({reasons})" if reasons else "")
                + "; start a new run without --resume"
            )
        reserve_space(run_dir, world_size)  # before anything changes: a disk without room is refused as it is
        reserved = True
        for p in passed_over:
            note = f"set aside as {set_aside(p.path).name}" if p.corrupt else "left in place"
            logger.warning(f"kanscale: --resume {run_dir}: passed over {p.path.name} ({p.why}; {note})")
    except BaseException:
        if reserved:
            free_space(run_dir)
        lock.release()
        raise
    if passed_over:
        logger.info(
            f"kanscale: --resume {run_dir}: resuming from {checkpoint.path.name}, the newest checkpoint that verifies"
        )
    if not checkpoint.verifiable:
        logger.warning(
            f"kanscale: --resume {run_dir}: {checkpoint.path.name} was written without checksums (by an earlier "
            "kanscale) and is used unverified"
        )
    return lock, {
        "previous": previous.model_dump(mode="json"),
        "checkpoint": str(checkpoint.path),
        "meta": checkpoint.meta,
        "steps": [s.model_dump(mode="json") for s in steps[: checkpoint.step]],
    }


def _on_rank0(env: DistEnv, decide: Callable[[], tuple[RunLock, dict[str, Any]]]) -> tuple[RunLock | None, dict]:
    """Run ``decide`` on rank 0 and give every rank its outcome; where it raised, rank 0 raises its
    error and every other rank a ConfigError (or RuntimeError) with the same message."""
    lock: RunLock | None = None
    outcome: dict[str, Any] = {}
    if env.is_main:
        try:
            lock, outcome = decide()
        except Exception as err:
            env.broadcast_string(
                json.dumps({"refused": str(err), "config": isinstance(err, (ConfigError, RecordError))})
            )
            raise
        env.broadcast_string(json.dumps(outcome, default=str))
        return lock, outcome
    outcome = json.loads(env.broadcast_string(""))
    if "refused" in outcome:
        raise (ConfigError if outcome["config"] else RuntimeError)(outcome["refused"])
    return None, outcome


def open_attempt(cfg: ExperimentConfig, env: DistEnv, run_dir: Path, resume: bool) -> Attempt:
    """Own ``run_dir`` (every rank calls this, with the same directory): a new run's, or one to
    resume. Refuses (ConfigError, on every rank) a run another one owns, a finished run, another
    experiment's, and one without a checkpoint that verifies."""
    if not resume:
        lock, _ = _on_rank0(env, lambda: (_take(run_dir, env.world_size), {}))
        return Attempt(run_dir, number=1, lock=lock)
    lock, outcome = _on_rank0(env, lambda: _decide_resume(cfg, env.world_size, run_dir))
    previous = RunRecord.model_validate(outcome["previous"])
    return Attempt(
        run_dir,
        number=len(previous.resumed_at_steps) + 2,
        lock=lock,
        previous=previous,
        checkpoint=Checkpoint(Path(outcome["checkpoint"]), outcome["meta"]),
        steps=[StepRecord.model_validate(s) for s in outcome["steps"]],
    )


def discard_abandoned_saves(out: Path) -> None:
    """Delete the partial checkpoints (``step-N.tmp``) of every run under ``out`` that no process
    holds any more: what the launcher does once all its ranks have ended with a failure. Rank 0
    deletes its run's partial save when it records the failure, but another rank may still be
    writing its part then (DeepSpeed creates the directory again); only after the last rank has
    ended is the partial save surely abandoned. A run whose lock is held is left alone."""
    for run_dir in sorted({p.parent.parent for p in Path(out).glob(f"*/checkpoints/*{PARTIAL}")}):
        try:
            lock = RunLock.acquire(run_dir)
        except ConfigError:  # still owned: a run of its own is in progress there
            continue
        try:
            discard_partial_saves(run_dir)
        finally:
            lock.release()
