"""One point of a sweep: the launch request it becomes, its run, and what became of it.

A launched point's run is the new record in OUT of that point's experiment and topology
(:func:`run_key`), never merely the first record that appeared while it ran. With ``--resume``
the point's n-th repeat is skipped where n complete records exist, and an unfinished run with a
checkpoint is continued; the unfinished ones without one are set aside when the point runs
(:mod:`launchers.studies.leftovers`). A signal during the launch stops the point's processes and
raises :class:`SweepStopped`.
"""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from analysis.records.run_files import RecordError, read_summary
from analysis.records.schema import RunRecord
from kanscale.errors import ConfigError
from launchers.launch.commands import LauncherName, LaunchSpec, launcher_name
from launchers.launch.request import RunRequest
from launchers.launch.run import execute, plan
from launchers.launch.slurm import write_script
from launchers.launch.slurm_jobs import job_id
from launchers.studies.leftovers import no_strays, set_aside_runs
from launchers.studies.study import Point, StudyConfig, strategy_config
from strategies.lifecycle.checkpoint import latest_checkpoint
from strategies.lifecycle.disk import free_bytes
from strategies.lifecycle.failures import STOPPED, Terminated

# Two names for this machine: the deepspeed launcher needs one distinct host name per node.
LOCAL_HOSTS = ["localhost", "127.0.0.1"]
# the most of a failed point's reason that is shown and logged
REASON_CHARS = 2000


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
    """The signal behind a stop: a stopped point's own, Terminated is raise_on_sigterm's SIGTERM,
    KeyboardInterrupt Ctrl-C."""
    if isinstance(err, SweepStopped) and err.result.signal is not None:
        return signal.Signals[err.result.signal]
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


def records_under(out: Path) -> list[RunRecord]:
    records = []
    for summary in sorted(out.glob("*/summary.json")):
        try:
            records.append(read_summary(summary))
        except RecordError:
            continue
    return records


def launcher_for(study: StudyConfig, point: Point) -> LauncherName:
    """SLURM studies write scripts for every point; otherwise the launcher the point's strategy
    asks for (``single``: one plain process, ``accelerate``: accelerate launch), else the study's."""
    if study.launcher == "slurm":
        return "slurm"
    preferred = strategy_config(point.strategy).preferred_launcher if point.strategy else None
    return launcher_name(preferred or study.launcher)


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
    replaced: Sequence[str] = (),
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
        error = record.error if record else None
        reason = f"{error.type}: {error.message}" if error else why_it_ended(code, log, out)
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


def why_it_ended(code: int | None, log: Path, out: Path) -> str:
    """A point that left no record of its failure: its exit code and the error its log ends with
    (``kanscale: ...``), or, where the log says nothing (a disk too full for it), a full disk under
    OUT named as the cause."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("kanscale: ")]
    except OSError:
        lines = []
    if lines:
        return f"exit code {code}: {lines[-1].removeprefix('kanscale: ')}"
    free = free_bytes(out)
    if free == 0:
        return f"exit code {code}: DiskFull: the disk holding {out} is full (0 bytes free); make room there and rerun"
    return f"exit code {code}"


def one_line(message: str) -> str:
    """A failure's whole message on one line, for the progress lines, the summary and
    sweep.jsonl: a config's problems come one per line after a first line that only names the
    file, so the first line alone would hide them. Cut at REASON_CHARS."""
    text = " ".join(line.strip() for line in message[: REASON_CHARS + 1].splitlines() if line.strip())
    if len(message) <= REASON_CHARS:
        return text
    return f"{text[:REASON_CHARS]}... ({len(message) - REASON_CHARS} more characters)"
