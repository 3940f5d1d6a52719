"""What an interrupted sweep point leaves behind: a stale run directory, and stray processes.

A stale run is one of the point's unfinished runs with no checkpoint (killed, stopped or failed
before its first): nothing can continue it, so ``kanscale sweep --resume`` runs the point again
(or continues another of its runs that has a checkpoint).
Left where it was, ``kanscale analyze`` (which reads every ``summary.json`` under OUT, at any
depth) would count it beside the rerun, and the verdict would say the point did not finish. It
is not rerun in its own directory either: that means clearing its record, its steps and its
failure reports, and nothing a run wrote is thrown away. So the whole directory is archived as
``OUT/stale/<run_id>.tar`` (``tar -xf`` gives it back as it was) and then removed: a tar is a
file analyze does not read, wherever it lies. Only a half-written checkpoint (``*.tmp``) is left
out of it; the next save would have deleted it (strategies/lifecycle/checkpoint.py: prune).

Stray processes: the launcher of a point starts its ranks in sessions of their own (torchrun does),
so stopping the launcher's process group reaches the ranks only through the launcher, and a
launcher killed after the grace period (launchers/launch/run.py: stop_all) before its ranks have
ended (torchrun waits 30 s for them) leaves them running with no parent. While a point runs the
sweep is the subreaper of its descendants, so such a rank becomes the sweep's child, and
:func:`no_strays` ends it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path

from analysis.records.run_files import CONFIG_FILE, STEPS_FILE, SUMMARY_FILE
from kanscale import log
from kanscale.errors import ConfigError
from strategies.lifecycle.checkpoint import checkpoints_dir
from strategies.lifecycle.run_lock import RunLock

logger = log.get(__name__)

STALE_DIR = "stale"
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h


def set_aside_runs(out: Path, run_dirs: list[Path], point: str) -> list[str]:
    """Archive each stale run directory as ``OUT/stale/<name>.tar`` and remove it, saying so on
    stderr; the archives' paths. A run whose lock is held is still running (another sweep's, or
    a job's) and is left alone."""
    archived = []
    for run_dir in run_dirs:
        try:
            lock = RunLock.acquire(run_dir)  # no run may start in it (a --resume) while it is archived
        except ConfigError as err:
            logger.info(f"[sweep] {point}: {run_dir} left in place: {err}")
            continue
        try:
            archive = archive_run(out, run_dir)
        except OSError as err:  # a full disk, a permission: the run stays as it was, and is counted
            logger.warning(
                f"{point}: {run_dir} could not be set aside ({err}); left in place, where kanscale analyze "
                "counts it beside this point's new run"
            )
            continue
        finally:
            lock.release()
        logger.info(
            f"[sweep] {point}: {run_dir.name} has no checkpoint to continue from: the stale run is set aside as "
            f"{archive} (tar -xf gives it back), where kanscale analyze does not count it beside this point's new run"
        )
        archived.append(str(archive))
    return archived


def archive_run(out: Path, run_dir: Path) -> Path:
    archive = out / STALE_DIR / f"{run_dir.name}.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = checkpoints_dir(run_dir).relative_to(run_dir.parent).as_posix() + "/"
    tmp = archive.with_name(f".{archive.name}.tmp")
    try:
        with tarfile.open(tmp, "w") as tar:
            tar.add(
                run_dir,
                arcname=run_dir.name,
                filter=lambda info: None if info.name.startswith(partial) and info.name.endswith(".tmp") else info,
            )
        os.replace(tmp, archive)  # complete, or not there: the directory is removed only once it is
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # What analyze reads goes first: a sweep stopped half-way through the removal leaves nothing
    # it counts (the archive has it all).
    for name in (SUMMARY_FILE, STEPS_FILE, CONFIG_FILE):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir)
    return archive


def children() -> set[int]:
    """This process's children, running or ended and not yet reaped (from /proc)."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name before ")" may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if parent == me:
            found.add(int(stat.parent.name))
    return found


def subreaper(on: int) -> int:
    """Make this process the subreaper of its descendants (1) or not (0); what it was before.
    Linux only: elsewhere nothing changes and stop_all's process groups are all there is."""
    with contextlib.suppress(OSError, AttributeError):
        libc, was = ctypes.CDLL(None, use_errno=True), ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0)
        return was.value
    return 0


@contextlib.contextmanager
def no_strays(point: str) -> Iterator[None]:
    """Run a launch as the subreaper of what it starts, and afterwards kill and reap every child of
    this process that was not one before: once a launch has returned (or been stopped), its own
    processes have been waited for, so any other child is a rank it left behind (or one that ended
    as an orphan and waits to be reaped). Killing one may orphan its own children in turn, which
    become ours: repeat until none is left."""
    known, was = children(), subreaper(1)
    try:
        yield
    finally:
        killed = []
        while strays := children() - known:
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in strays:
                with contextlib.suppress(ChildProcessError):
                    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL:
                        killed.append(pid)
        subreaper(was)
        if killed:
            logger.warning(f"{point}: killed {len(killed)} process(es) its launcher left running: {killed}")
