"""What happens when a run goes wrong: failure reports, finding the rank that started it, the
launcher's termination signal, non-finite losses, and fault injection for the tests.

When one rank fails, the others usually fail after it, in a collective that lost its peer or
timed out (``runtime.timeout_s``), or because the launcher terminates them. Every rank that fails
writes ``failures/attempt-<n>/rank<R>.json`` in the run directory and then rewrites the run record
from all reports so far, one rank at a time, so whichever rank writes last has the whole picture.
Attempt n is the run's n-th start (1, then one more per ``--resume``): an attempt's reports are its
own, so a failure an earlier attempt recorded is never taken for the cause of a later one, and
nothing an earlier attempt wrote is removed. The record's error is the root cause: the earliest
report that is not a consequence of another rank's failure; else a rank that never reported (a
crash or a kill); else a rank the launcher had to terminate while another timed out waiting for it
(a hang); else, when a rank was terminated and none had failed, the run was stopped by a signal (a
user's kill, scancel, a time limit); else the earliest report.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from analysis.records.schema import RunError
from kanscale import log
from kanscale.writes import atomic_write_text
from strategies.sections import FaultConfig

logger = log.get(__name__)

FAILURES_DIR = "failures"
# The error type of a run stopped by a signal that no rank's failure preceded.
STOPPED = "Terminated"
# Messages of errors that follow from another rank's failure rather than cause one.
TIMEOUT_HINTS = ("timed out", "timeout")
LOST_PEER_HINTS = ("connection closed", "connection reset", "broken pipe", "by peer", "socket")


class Terminated(BaseException):
    """This rank was asked to stop with SIGTERM: by the launcher after another rank failed, or by
    a user or the scheduler (root_cause tells which from the other ranks' reports)."""


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class FailureReport:
    rank: int
    step: int  # steps this rank had completed
    type: str
    message: str
    time: float

    @property
    def kind(self) -> str:
        """``terminated`` (by a signal), ``timeout`` (waited too long for another rank), ``lost``
        (another rank's connection went away), or ``primary`` (a failure of its own)."""
        message = self.message.lower()
        if self.type == "Terminated":
            return "terminated"
        if any(hint in message for hint in TIMEOUT_HINTS):
            return "timeout"
        if self.type in ("DistBackendError", "DistNetworkError", "DistStoreError") or any(
            h in message for h in LOST_PEER_HINTS
        ):
            return "lost"
        return "primary"


def reports_dir(run_dir: Path, attempt: int) -> Path:
    """Where the failure reports of a run's ``attempt``-th start go."""
    return Path(run_dir) / FAILURES_DIR / f"attempt-{attempt}"


@contextlib.contextmanager
def reports_locked(folder: Path) -> Iterator[None]:
    """Hold the reports' lock: one rank at a time writes its report, reads them all and rewrites the
    record. Without it two ranks failing together can each read the reports before the other's
    lands, and the record keeps the picture of whichever wrote last, not the whole one."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:
        # A filesystem without locks: the reports are still written, the race stays open.
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_report(folder: Path, report: FailureReport) -> None:
    atomic_write_text(Path(folder) / f"rank{report.rank}.json", json.dumps(asdict(report)))


def record_failure(
    folder: Path,
    report: FailureReport,
    world_size: int,
    write: Callable[[RunError], None],
    make_room: Callable[[], None] = lambda: None,
    tries: int = 10,
) -> None:
    """Under the reports' lock, write this rank's report and then the record (``write``, given the
    root cause of every report so far). A full disk that the reserve of strategies/lifecycle/disk.py
    could not cover (another rank, still writing its part of a checkpoint, took the room the reserve
    freed) gets ``make_room`` (the partial checkpoint deleted) and, while that rank's open file still
    holds the blocks, a few more tries half a second apart. Where even that finds no room, the
    failure is said on stderr, where it fits, and the record keeps its last version."""
    for attempt in range(tries):
        try:
            with reports_locked(folder):
                write_report(folder, report)
                write(root_cause(read_reports(folder), world_size))
            return
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == tries - 1:
                logger.error(
                    f"kanscale: rank {report.rank} could not record its failure in {Path(folder).parent.parent} "
                    f"({err}); it failed with {report.type}: {report.message}"
                )
                return
            make_room()
            time.sleep(0.5)


def read_reports(folder: Path) -> list[FailureReport]:
    folder = Path(folder)
    reports = []
    for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            reports.append(FailureReport(**json.loads(path.read_text())))
        except (ValueError, TypeError):
            continue  # a report torn by a kill mid-write carries no information
    return reports


def root_cause(reports: list[FailureReport], world_size: int) -> RunError:
    """The error a run record shows, from every rank's report (see the module docstring)."""
    by_time = sorted(reports, key=lambda r: r.time)
    primary = [r for r in by_time if r.kind == "primary"]
    if primary:
        first = primary[0]
        return RunError(type=first.type, message=first.message, rank=first.rank, step=first.step)
    seen = by_time[0]
    silent = sorted(set(range(world_size)) - {r.rank for r in reports})
    if silent:
        return RunError(
            type="RankLost",
            rank=silent[0],
            step=seen.step,
            message=f"rank {silent[0]} ended without reporting an error (it crashed or was killed); "
            f"rank {seen.rank} then saw: {seen.type}: {seen.message}",
        )
    terminated = [r for r in by_time if r.kind == "terminated"]
    timed_out = [r for r in by_time if r.kind == "timeout"]
    if terminated and timed_out:
        hung = terminated[0]
        return RunError(
            type="RankHung",
            rank=hung.rank,
            step=hung.step,
            message=f"rank {hung.rank} stopped responding: rank {timed_out[0].rank} gave up waiting for it "
            f"(runtime.timeout_s) and the launcher then terminated it; rank {timed_out[0].rank} saw: "
            f"{timed_out[0].type}: {timed_out[0].message}",
        )
    if terminated:  # and every other report followed from it: nothing failed before the signal
        first = terminated[0]
        return RunError(
            type=STOPPED,
            rank=first.rank,
            step=first.step,
            message=f"the run was stopped by a signal (SIGTERM to rank {first.rank} after step {first.step}) "
            "before any rank failed: a user's kill, scancel or a job's time limit; continue it "
            "from its latest checkpoint with --resume",
        )
    return RunError(type=seen.type, message=seen.message, rank=seen.rank, step=seen.step)


_reporting = False  # set while this rank writes its failure report (see reporting_failure)


@contextlib.contextmanager
def reporting_failure() -> Iterator[None]:
    """While a rank reports its failure, a SIGTERM does not interrupt it: the launcher sends one
    as soon as another rank has ended, often while this rank reports an error of its own (a lost
    connection), and a Terminated raised half-way would leave the record and the last steps
    unwritten. The rank ends right after; the launcher's SIGKILL still ends one stuck here."""
    global _reporting
    _reporting = True
    try:
        yield
    finally:
        _reporting = False


def raise_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` so the failure is recorded before the process ends.
    Only the main thread can install handlers; elsewhere this does nothing."""

    def handler(signum: int, frame: object) -> None:
        # Once is enough: launchers often send several (under SLURM both slurmstepd and the
        # deepspeed launcher do, milliseconds apart), and a second Terminated raised inside the
        # first one's failure report would stop it before the run record is rewritten.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not _reporting:
            raise Terminated("terminated by SIGTERM")

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, handler)


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise NonFiniteLoss(
            f"the training loss became {loss} at step {step}; lower training.lr, set training.grad_clip, "
            "or check the task's data"
        )


def inject_fault(fault: FaultConfig | None, rank: int, step: int) -> None:
    """Fail as ``fault`` says if this is its rank and step (1-based, at the step's start)."""
    if fault is None or step != fault.step or fault.rank not in (rank, "all"):
        return
    if fault.kind == "exception":
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if fault.kind == "exit":
        os._exit(3)  # no cleanup, no report: as a crash or the OOM killer would end it
    while True:  # hang: the others must not wait for this rank forever
        time.sleep(3600)
