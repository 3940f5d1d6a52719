"""``kanscale sweep``: run every point of a study, one launch each, and keep going past failures.

Each point's output goes to ``OUT/logs/<point>.log``; what became of each point is appended to
``OUT/sweep.jsonl``. With ``--resume`` a point whose run record in OUT is complete (status ok)
for the same resolved config is skipped. Points whose world spans several nodes are started on
this machine as that many nodes (127.0.0.1), unless the study's launcher is SLURM, which writes
one sbatch script per point instead; with ``--submit`` it submits them, and with ``--wait`` it
follows the jobs until each has ended and logs the point's final status from its run record.
``--resume`` does not submit again a point whose job from an earlier submission still lives.

One sweep at a time owns an output directory: it holds ``OUT/.sweep.lock`` (:class:`SweepLock`,
the run directories' locking mechanism) from its first point to its last, and a second sweep on
the same OUT is refused naming the holder. How one point runs, and what its run record says
became of it: :mod:`launchers.studies.point`.

A SIGTERM (a user's kill, SLURM's time limit) or Ctrl-C stops the sweep: the running point's
processes are stopped, the point is logged as ``stopped`` with the signal, and
:class:`SweepStopped` ends the sweep, which ``kanscale sweep`` turns into exit code 128 + the
signal's number. ``--resume`` then continues the study (:mod:`launchers.studies.leftovers`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from kanscale import log
from kanscale.directories import check_output_dir
from kanscale.errors import ConfigError
from kanscale.writes import open_to_append
from launchers.launch.slurm_jobs import follow, is_active, job_state
from launchers.studies.point import (
    EarlierRuns,
    PointResult,
    SweepStopped,
    earlier_runs,
    one_line,
    records_under,
    run_point,
    stop_signal,
)
from launchers.studies.study import Point, StudyConfig, axis_label, expand, load_study
from strategies.experiment import load_experiment
from strategies.lifecycle.failures import Terminated, raise_on_sigterm
from strategies.lifecycle.run_lock import DirectoryLock

logger = log.get(__name__)


class SweepLock(DirectoryLock):
    """A sweep's hold on its output directory, for as long as it runs points there."""

    FILE, HOLDER, OWNS = ".sweep.lock", "sweep", "an output directory"
    INSTEAD = "then run again (--resume skips the points it completed), or give another --out"


def matches(point: Point, only: list[str]) -> bool:
    """``--only strategy=zero3 --only topology=1x2 --only widths=[2,64,1]``: every filter holds."""
    for condition in only:
        key, _, value = condition.partition("=")
        axis = next((a for a in point.axes if a == key or a.split(".")[-1] == key), None)
        if axis is None:
            raise ConfigError(f"--only {condition}: no axis {key!r}; axes: {', '.join(point.axes)}")
        if axis_label(point.axes[axis]).replace(" ", "") != value.replace(" ", ""):
            return False
    return True


def run_sweep(
    study_path: str,
    out: str,
    resume: bool = False,
    dry_run: bool = False,
    only: Sequence[str] = (),
    submit_jobs: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    oversubscribe: bool = False,
    overrides: Sequence[str] = (),
) -> list[PointResult]:
    """``overrides``: ``--set`` lines applied to every point after the study's own (a misspelled
    key is refused here, before any point runs)."""
    study = load_study(study_path)
    out_dir = Path(out)
    check_output_dir(out_dir, "--out", "for the sweep's runs")
    if submit_jobs and study.launcher != "slurm":
        raise ConfigError(
            f"--submit: {study_path} has launcher: {study.launcher}, so its points train here, one after "
            "another, and there is nothing to submit; set launcher: slurm in the study to write and submit "
            "sbatch scripts, or drop --submit"
        )
    if wait and not submit_jobs:
        raise ConfigError(
            "--wait follows the SLURM jobs a sweep submits; add --submit (and launcher: slurm in the study)"
        )
    points, notes = expand(study, overrides)
    if overrides:  # checked with each point's own axes: the study's set: alone may leave a choice to them
        for point in points:
            try:
                load_experiment(study.experiment, point.overrides)
            except ConfigError as err:
                raise ConfigError(f"--set (point {point.key}): {err}") from None
    points = [p for p in points if matches(p, list(only))]
    if not points:
        raise ConfigError(f"--only {' '.join(only)}: no point of {study_path} matches")
    for note in notes:
        logger.info(f"[sweep] not run: {note}")
    lock = None if dry_run else SweepLock.acquire(out_dir)  # a dry run writes nothing
    try:
        return run_points(study, points, out_dir, resume, dry_run, submit_jobs, wait, progress, oversubscribe)
    finally:
        if lock is not None:
            lock.release()


def run_points(
    study: StudyConfig,
    points: list[Point],
    out_dir: Path,
    resume: bool,
    dry_run: bool,
    submit_jobs: bool,
    wait: bool,
    progress: bool | None,
    oversubscribe: bool,
) -> list[PointResult]:
    """Run (or plan) ``points`` in order into ``out_dir``, logging each; the sweep's loop."""
    earlier = earlier_runs(out_dir) if resume else EarlierRuns()
    alive = live_submissions(out_dir) if resume and submit_jobs else {}
    results: list[PointResult] = []
    interactive = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(points, unit="point", disable=dry_run or not interactive, file=sys.stderr, dynamic_ncols=True)
    start = time.monotonic()
    raise_on_sigterm()  # from here on a SIGTERM stops the sweep as below, whatever it is doing
    with log.beside_bar():
        for n, point in enumerate(bar, start=1):
            bar.set_description(point.key[:60])
            try:
                if point.key in alive:
                    result = PointResult(
                        point.key,
                        "submitted",
                        job_id=alive[point.key],
                        detail=f"job {alive[point.key]} of an earlier submission still lives; not submitted again",
                    )
                else:
                    result = run_point(study, point, out_dir, earlier, dry_run, submit_jobs, oversubscribe)
            except (Terminated, KeyboardInterrupt) as err:  # before its launch (a launch raises SweepStopped)
                if dry_run:
                    raise
                name = stop_signal(err).name
                raise stopped(
                    out_dir,
                    study,
                    PointResult(
                        point.key,
                        "stopped",
                        signal=name,
                        detail=f"the sweep was stopped by {name} before this point was launched",
                    ),
                ) from None
            except SweepStopped as err:
                raise stopped(out_dir, study, err.result) from None
            results.append(result)
            if dry_run:
                if result.status == "failed":  # the point's commands are not printed: say why
                    logger.error(f"cannot plan {point.key}: {result.detail}")
                continue
            log_result(out_dir, study, result)
            eta = (time.monotonic() - start) / n * (len(points) - n)
            logger.info(
                f"[sweep] {n}/{len(points)} {result.status:9s} {point.key} ({result.seconds:.1f} s"
                + ("" if interactive else f", eta {eta:.0f} s")
                + ")"
                + (f" {result.detail}" if result.detail else "")
            )
    if wait:
        results = follow_submitted(out_dir, study, results)
    return results


def stopped(out: Path, study: StudyConfig, result: PointResult) -> SweepStopped:
    """Log a point the sweep was stopped during; the stop to raise."""
    log_result(out, study, result)
    logger.info(f"[sweep] stopped   {result.point} ({result.seconds:.1f} s) {result.detail}")
    return SweepStopped(result)


def live_submissions(out: Path) -> dict[str, str]:
    """Points whose latest entry in OUT/sweep.jsonl is a submitted job that is still queued or
    running: point -> job id."""
    latest: dict[str, dict] = {}
    log = out / "sweep.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:
        entry = json.loads(line)
        latest[entry["point"]] = entry
    return {
        point: entry["job_id"]
        for point, entry in latest.items()
        if entry["status"] == "submitted" and entry.get("job_id") and is_active(job_state(entry["job_id"]))
    }


def follow_submitted(out: Path, study: StudyConfig, results: list[PointResult]) -> list[PointResult]:
    """Wait for every submitted point's job; replace its result with the final one, from the
    run record the job wrote (found by the job id it records)."""
    index = {r.job_id: n for n, r in enumerate(results) if r.status == "submitted" and r.job_id}

    def ended(job: str, state: str | None) -> None:
        submitted = results[index[job]]
        record = next((r for r in records_under(out) if r.environment.slurm_job_id == job), None)
        if record is not None and record.status == "ok":
            final = PointResult(submitted.point, "ok", run_id=record.run_id, job_id=job)
        else:
            reason = (
                one_line(f"{record.error.type}: {record.error.message}")
                if record and record.error
                else f"job {job} ended ({state or 'its state is no longer known'}) without a complete run record"
            )
            final = PointResult(
                submitted.point,
                "failed",
                run_id=record.run_id if record else None,
                job_id=job,
                detail=f"{reason}; see {out / 'slurm'}",
            )
        results[index[job]] = final
        log_result(out, study, final)
        logger.info(f"[sweep] job {job} {final.status:9s} {final.point}" + (f" {final.detail}" if final.detail else ""))

    follow(list(index), ended)
    return results


def log_result(out: Path, study: StudyConfig, result: PointResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    entry = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "study": study.study,
        **dataclasses.asdict(result),
    }
    with open_to_append(out / "sweep.jsonl") as f:
        f.write(json.dumps(entry) + "\n")
