"""What happens when a run goes wrong: failure reports, finding the rank that started it, the
launcher's termination signal, non-finite losses, and fault injection for the tests.

When one rank fails, the others usually fail after it, in a collective that lost its peer or
timed out (``runtime.timeout_s``), or because the launcher terminates them. Every rank that fails
writes ``failures/rank<R>.json`` in the run directory and then rewrites the run record from all
reports so far, so whichever rank writes last has the whole picture. The record's error is the
root cause: the earliest report that is not a consequence of another rank's failure; else a rank
that never reported (a crash or a kill); else a rank the launcher had to terminate while another
timed out waiting for it (a hang); else the earliest report.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from analysis.schema import RunError
from strategies.config import FaultConfig

FAILURES_DIR = "failures"
# Messages of errors that follow from another rank's failure rather than cause one.
TIMEOUT_HINTS = ("timed out", "timeout")
LOST_PEER_HINTS = ("connection closed", "connection reset", "broken pipe", "by peer", "socket")


class Terminated(BaseException):
    """The launcher (or a user) asked this rank to stop, with SIGTERM."""


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
        if self.type in ("DistBackendError", "DistNetworkError", "DistStoreError") or any(h in message for h in LOST_PEER_HINTS):
            return "lost"
        return "primary"


def write_report(run_dir: Path, report: FailureReport) -> None:
    folder = Path(run_dir) / FAILURES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{report.rank}.json.tmp"
    tmp.write_text(json.dumps(asdict(report)))
    os.replace(tmp, folder / f"rank{report.rank}.json")


def read_reports(run_dir: Path) -> list[FailureReport]:
    folder = Path(run_dir) / FAILURES_DIR
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
        return RunError(type="RankLost", rank=silent[0], step=seen.step,
                        message=f"rank {silent[0]} ended without reporting an error (it crashed or was killed); "
                                f"rank {seen.rank} then saw: {seen.type}: {seen.message}")
    terminated = [r for r in by_time if r.kind == "terminated"]
    timed_out = [r for r in by_time if r.kind == "timeout"]
    if terminated and timed_out:
        hung = terminated[0]
        return RunError(type="RankHung", rank=hung.rank, step=hung.step,
                        message=f"rank {hung.rank} stopped responding: rank {timed_out[0].rank} gave up waiting for it "
                                f"(runtime.timeout_s) and the launcher then terminated it; rank {timed_out[0].rank} saw: "
                                f"{timed_out[0].type}: {timed_out[0].message}")
    return RunError(type=seen.type, message=seen.message, rank=seen.rank, step=seen.step)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` so the failure is recorded before the process ends.
    Only the main thread can install handlers; elsewhere this does nothing."""

    def handler(signum: int, frame: object) -> None:
        # Once is enough: launchers often send several (under SLURM both slurmstepd and the
        # deepspeed launcher do, milliseconds apart), and a second Terminated raised inside the
        # first one's failure report would stop it before the run record is rewritten.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("terminated by SIGTERM (the launcher stops every rank when one fails)")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        pass


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"the training loss became {loss} at step {step}; lower training.lr, set training.grad_clip, "
                            "or check the task's data")


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
