"""Following submitted SLURM jobs: their id from sbatch's reply, their state while they live and
after they end.

``squeue`` knows a job while it is queued or running. Once it ended, ``sacct`` knows it where
the cluster keeps accounting, and ``scontrol show job`` until the controller forgets it
(``MinJobAge``); a job none of them knows any more has ended, and its run record says how.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable

from kanscale import log

logger = log.get(__name__)

SUBMITTED = re.compile(r"Submitted batch job (\d+)")
# states of a job that has not ended (squeue's long names)
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "RESV_DEL_HOLD",
    "REQUEUE_FED",
}


def job_id(sbatch_reply: str) -> str | None:
    match = SUBMITTED.search(sbatch_reply)
    return match.group(1) if match else None


def _query(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return ""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else ""


def job_state(job: str) -> str | None:
    """The job's state (``RUNNING``, ``COMPLETED``, ``FAILED``, ...), or None where no SLURM
    tool knows it any more."""
    queued = _query(["squeue", "--noheader", "--jobs", job, "--format=%T"])
    if queued:
        return queued.split()[0]
    accounted = _query(["sacct", "--noheader", "--allocations", "--parsable2", "--jobs", job, "--format=State"])
    if accounted:
        return accounted.split()[0]  # "CANCELLED by 0" -> CANCELLED
    shown = re.search(r"JobState=(\S+)", _query(["scontrol", "show", "job", "--oneliner", job]))
    return shown.group(1) if shown else None


def is_active(state: str | None) -> bool:
    return state in ACTIVE


def follow(jobs: list[str], on_end: Callable[[str, str | None], None], poll_s: float = 5.0) -> None:
    """Wait until every job has ended, calling ``on_end(job, final state)`` as each does."""
    waiting = list(dict.fromkeys(jobs))
    reported = 0.0
    while waiting:
        for job in list(waiting):
            state = job_state(job)
            if not is_active(state):
                waiting.remove(job)
                on_end(job, state)
        if waiting:
            if time.monotonic() - reported > 60:
                logger.info(f"[slurm] waiting for {len(waiting)} SLURM job(s): {', '.join(waiting)}")
                reported = time.monotonic()
            time.sleep(poll_s)
