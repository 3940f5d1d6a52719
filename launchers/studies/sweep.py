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
the same OUT is refused naming the holder. A launched point's run is the new record in OUT of
that point's experiment and topology (:func:`run_key`), never merely the first record that
appeared while it ran.

A SIGTERM (a user's kill, SLURM's time limit) or Ctrl-C stops the sweep: the running point's
processes are stopped, the point is logged as ``stopped`` with the signal, and
:class:`SweepStopped` ends the sweep, which ``kanscale sweep`` turns into exit code 128 + the
signal's number. ``--resume`` then continues the study (:mod:`launchers.studies.leftovers`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from analysis.records import RecordError, read_summary
from analysis.schema import RunRecord
from kanscale import log
from kanscale.directories import check_output_dir
from kanscale.errors import ConfigError
from launchers.launch.commands import LaunchSpec
from launchers.launch.request import RunRequest
from launchers.launch.run import execute, plan
from launchers.launch.slurm import write_script
from launchers.launch.slurm_jobs import follow, is_active, job_id, job_state
from launchers.studies.leftovers import no_strays, set_aside_runs
from launchers.studies.study import Point, StudyConfig, axis_label, expand, load_study, strategy_config
from strategies.experiment import load_experiment
from strategies.lifecycle.checkpoint import latest_checkpoint
from strategies.lifecycle.failures import STOPPED, Terminated, raise_on_sigterm
from strategies.lifecycle.run_lock import DirectoryLock

logger = log.get(__name__)

# Two names for this machine: the deepspeed launcher needs one distinct host name per node.
LOCAL_HOSTS = ["localhost", "127.0.0.1"]
# the most of a failed point's reason that is shown and logged
REASON_CHARS = 2000


class SweepLock(DirectoryLock):
    """A sweep's hold on its output directory, for as long as it runs points there."""

    FILE, HOLDER, OWNS = ".sweep.lock", "sweep", "an output directory"
    INSTEAD = "then run again (--resume skips the points it completed), or give another --out"


@dataclass
class PointResult:
    point: str
    status: str  # ok | failed | stopped | skipped | written | submitted | planned
    seconds: float = 0.0
    run_id: str | None = None
    detail: str = ""
    job_id: str | None = None  # the SLURM job of a submitted point
    signal: str | None = None  # what stopped a stopped point: SIGTERM or SIGINT
    set_aside: list[str] = field(default_factory=list)  # earlier runs of the point this one replaces


class SweepStopped(Exception):
    """The sweep was stopped by a signal while ``result.point`` ran; the point's processes have
    been stopped and ``result`` (status stopped) logged."""

    def __init__(self, result: PointResult) -> None:
        super().__init__(f"stopped by {result.signal} during {result.point}")
        self.result = result


def stop_signal(err: BaseException) -> signal.Signals:
    """The signal behind a stop: Terminated is raise_on_sigterm's SIGTERM, KeyboardInterrupt Ctrl-C."""
    return signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM


RunKey = tuple[str, int, int]


def run_key(digest: str, nodes: int, procs_per_node: int) -> RunKey:
    """What makes two runs the same point: the resolved experiment and where its ranks ran."""
    return digest, nodes, procs_per_node


@dataclass
class EarlierRuns:
    """The run records under OUT by point, oldest first: the complete ones, the unfinished ones
    with a checkpoint to resume from, and the unfinished ones without one (``stale``: a rerun of
    the point starts afresh and sets them aside)."""

    done: dict[RunKey, list[RunRecord]] = field(default_factory=dict)
    resumable: dict[RunKey, list[RunRecord]] = field(default_factory=dict)
    stale: dict[RunKey, list[RunRecord]] = field(default_factory=dict)


def earlier_runs(out: Path) -> EarlierRuns:
    earlier = EarlierRuns()
    for record in records_under(out):
        if record.status == "ok":
            kind = earlier.done
        else:
            kind = earlier.resumable if latest_checkpoint(out / record.run_id) is not None else earlier.stale
        t = record.topology
        kind.setdefault(run_key(record.config_digest, t.nodes, t.procs_per_node), []).append(record)
    return earlier


def launcher_for(study: StudyConfig, point: Point) -> str:
    """SLURM studies write scripts for every point; otherwise the launcher the point's strategy
    asks for (``single``: one plain process, ``accelerate``: accelerate launch), else the study's."""
    if study.launcher == "slurm":
        return "slurm"
    preferred = strategy_config(point.strategy).preferred_launcher if point.strategy else None
    return preferred or study.launcher


def point_request(study: StudyConfig, point: Point, out: Path, oversubscribe: bool = False) -> RunRequest:
    launcher = launcher_for(study, point)
    local_multinode = point.nodes > 1 and launcher != "slurm"
    if local_multinode and launcher == "deepspeed" and point.nodes > len(LOCAL_HOSTS):
        raise ConfigError(
            f"topology {point.nodes}x{point.procs_per_node}: the deepspeed launcher can start at most "
            f"{len(LOCAL_HOSTS)} nodes on one machine"
        )
    spec = LaunchSpec(
        launcher=launcher,
        nproc_per_node=point.procs_per_node,
        nnodes=point.nodes,
        rdzv_id=f"kanscale-{point.key}",
        no_ssh=True,
    )
    return RunRequest(
        config=study.experiment,
        out=str(out),
        spec=spec,
        given=frozenset({"nproc_per_node", "nnodes"}),
        overrides=point.overrides,
        strategy=point.strategy,
        slurm=study.slurm,
        job_name=f"kanscale-{study.study}-{point.key}"[:64],
        all_nodes_here=local_multinode,
        hosts=LOCAL_HOSTS[: point.nodes] if local_multinode and launcher == "deepspeed" else [],
        progress=False,
        oversubscribe=oversubscribe,
    )


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
    only: list[str] = (),
    submit_jobs: bool = False,
    wait: bool = False,
    progress: bool | None = None,
    oversubscribe: bool = False,
    overrides: list[str] = (),
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


def records_under(out: Path) -> list[RunRecord]:
    records = []
    for summary in sorted(out.glob("*/summary.json")):
        try:
            records.append(read_summary(summary))
        except RecordError:
            continue
    return records


def run_point(
    study: StudyConfig,
    point: Point,
    out: Path,
    earlier: EarlierRuns,
    dry_run: bool,
    submit_jobs: bool,
    oversubscribe: bool = False,
) -> PointResult:
    """Run one point. When resuming, ``earlier`` holds OUT's runs: the point's n-th repeat is
    skipped if n complete ones exist, an unfinished one with a checkpoint is continued, and the
    unfinished ones without are set aside when the point runs (all empty otherwise).
    A signal during the launch raises :class:`SweepStopped` once the point's processes are stopped."""
    start = time.monotonic()
    try:
        request = point_request(study, point, out, oversubscribe)
        cfg, request, launch = plan(request)
        key = run_key(cfg.digest(), point.nodes, point.procs_per_node)
        finished = earlier.done.get(key, [])
        if len(finished) <= point.repeat and earlier.resumable.get(key):
            request.resume = str(out / earlier.resumable[key].pop(0).run_id)
            cfg, request, launch = plan(request)
    except ConfigError as err:
        return PointResult(point.key, "failed", detail=one_line(str(err)))
    if len(finished) > point.repeat:
        return PointResult(point.key, "skipped", run_id=finished[point.repeat].run_id, detail="complete record exists")
    if dry_run:
        print(f"# {point.key}\n{launch.render()}\n")
        return PointResult(point.key, "planned")
    # The point's unfinished runs without a checkpoint can never be continued: this run (or the
    # job submitted) replaces them, afresh or resuming another (launchers/studies/leftovers.py).
    replaced = (
        []
        if request.spec.launcher == "slurm" and not submit_jobs
        else set_aside_runs(out, [out / r.run_id for r in earlier.stale.pop(key, [])], point.key)
    )
    if request.spec.launcher == "slurm":
        script, reply = write_script(launch, submit_jobs)
        return PointResult(
            point.key,
            "submitted" if submit_jobs else "written",
            detail=reply or f"sbatch {shlex.quote(str(script))}",
            job_id=job_id(reply or ""),
            set_aside=replaced,
        )
    log = out / "logs" / f"{point.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*/summary.json"))
    try:
        with no_strays(point.key):
            code = execute(launch, log=log, runs=out)
    except (Terminated, KeyboardInterrupt) as err:  # execute() has stopped the launch's processes
        raise SweepStopped(
            outcome(point, key, out, request, log, before, start, stopped_by=stop_signal(err), replaced=replaced)
        ) from None
    return outcome(point, key, out, request, log, before, start, code=code, replaced=replaced)


def outcome(
    point: Point,
    key: RunKey,
    out: Path,
    request: RunRequest,
    log: Path,
    before: set[Path],
    start: float,
    code: int | None = None,
    stopped_by: signal.Signals | None = None,
    replaced: list[str] = (),
) -> PointResult:
    """What became of a launched point, from its run record (the new one in OUT of this point's
    experiment and topology, ``key``, or the one it resumed): ok, failed, or stopped, by the
    sweep's signal (``stopped_by``) or by one its ranks got directly (their record says so: a
    user's kill of a rank, or of the launcher). A record of another experiment that appeared
    meanwhile (a ``kanscale train --out OUT``) is not this point's."""
    new = [
        r
        for r in map(read_summary, sorted(set(out.glob("*/summary.json")) - before))
        if run_key(r.config_digest, r.topology.nodes, r.topology.procs_per_node) == key
    ]
    record = new[0] if new else (read_summary(Path(request.resume)) if request.resume else None)
    run_id = record.run_id if record else None
    seconds, replaced = time.monotonic() - start, list(replaced)
    if stopped_by is None and code == 0 and record is not None and record.status == "ok":
        return PointResult(point.key, "ok", seconds, run_id, set_aside=replaced)
    if stopped_by is not None:
        ran = f"; its run {run_id} is recorded as {record.status}" if record else ""
        detail = (
            f"the sweep was stopped by {stopped_by.name} while this point ran and stopped its processes{ran}; "
            "kanscale sweep --resume continues it from its latest checkpoint, or runs it again"
        )
    elif record is not None and record.error is not None and record.error.type == STOPPED:
        stopped_by, detail = signal.SIGTERM, one_line(f"{record.error.type}: {record.error.message}")
    else:
        reason = f"{record.error.type}: {record.error.message}" if record and record.error else f"exit code {code}"
        return PointResult(
            point.key, "failed", seconds, run_id=run_id, detail=f"{one_line(reason)}; see {log}", set_aside=replaced
        )
    return PointResult(
        point.key,
        "stopped",
        seconds,
        run_id=run_id,
        detail=f"{detail}; see {log}",
        signal=stopped_by.name,
        set_aside=replaced,
    )


def one_line(message: str) -> str:
    """A failure's whole message on one line, for the progress lines, the summary and
    sweep.jsonl: a config's problems come one per line after a first line that only names the
    file, so the first line alone would hide them. Cut at REASON_CHARS."""
    text = " ".join(line.strip() for line in message[: REASON_CHARS + 1].splitlines() if line.strip())
    if len(message) <= REASON_CHARS:
        return text
    return f"{text[:REASON_CHARS]}... ({len(message) - REASON_CHARS} more characters)"


def log_result(out: Path, study: StudyConfig, result: PointResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    entry = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "study": study.study,
        **dataclasses.asdict(result),
    }
    with open(out / "sweep.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
