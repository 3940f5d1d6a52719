"""A full disk: named as such in the record, with room kept to write that record.

A write that fails for lack of space surfaces in several forms: an OSError with errno ENOSPC (or
EDQUOT, a quota) from Python's own writes (steps.jsonl, summary.json, the shard files of DCP, which
wraps each rank's error in a CheckpointException), but ``torch.save`` to a path, as the torch and
DeepSpeed checkpoints are written, fails with a bare RuntimeError from its zip writer ("unexpected
pos 704 vs 598"), with no errno at all. :func:`disk_full` finds the errno in an exception's chain,
and takes such a zip-writer error on a filesystem left with (almost) no space for a full disk too.
Its :class:`DiskFull` names the path, the errno and the space left; it is the record's error.

Recording the failure needs space as well: a new summary.json is written beside the old one
before it replaces it, and every failing rank writes a report in a new folder. On a full disk
those writes fail and the record stays ``incomplete`` with no error. So rank 0 reserves that room
when it takes a run directory (:func:`reserve_space`, ``RUN_DIR/.space-reserve``) and a failing
rank deletes the reserve (:func:`free_space`) before it writes its report and the record.

Why a reserve (the "ballast file" databases keep for the same reason) and not the alternatives:
rewriting summary.json in place needs no new blocks only while it does not grow, and a failed
record is larger than the incomplete one (it gains the error); in place it is also no longer
atomic, so a kill would tear it. Writing the failure somewhere else (stderr, /tmp) leaves the
record wrong, and the record is what analysis reads. Deleting a file frees its blocks at once on
local filesystems (ext4, xfs, tmpfs) and network ones (NFS, Lustre, GPFS). The reserve is written
with random bytes, so a filesystem that compresses or deduplicates (ZFS, btrfs) really allocates
it: zeros or fallocate would reserve nothing there, or are not supported. What it cannot cover: a
filesystem that frees deleted blocks only later (a snapshot still holding them), and another
process taking the freed space first; the record write then fails, and the failure is said on
stderr instead (strategies/lifecycle/failures.py: record_failure).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

RESERVE_FILE = ".space-reserve"
# A record is a few KB (64 KiB at the outside, with a long error message), written once more as the
# temporary file that replaces it; the reports' text is a few hundred bytes each.
RECORD_ROOM = 128 * 1024
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Free space below which a zip-writer error (no errno) is taken for a full disk: a write that ran
# out of space leaves less than one buffer free; one that failed otherwise leaves the disk as it was.
NEARLY_FULL = 1 << 20
ZIP_WRITER = ("inline_container", "PytorchStreamWriter")  # torch.save's C++ writer, in its messages


class DiskFull(OSError):
    """A write that failed because its filesystem is full: where, the errno, and the space left."""

    def __init__(self, code: int | None, path: Path, what: str, free: int | None, seen: str | None = None) -> None:
        super().__init__(code or errno.ENOSPC, os.strerror(code or errno.ENOSPC), str(path))
        left = f"{free} bytes free there now" if free is not None else "the free space there cannot be read"
        said = (
            f"[Errno {code}] {os.strerror(code)} ({errno.errorcode[code]}); {left}"
            if code
            else f"{seen} (torch's writer gives no errno) with {left}: no space left on device (ENOSPC, errno "
            f"{errno.ENOSPC})"
        )
        self.text = (
            f"the disk is full: writing {what} {path} failed with {said}. Make room there (or set output.dir "
            "to a disk with room) and run again; a run with a checkpoint continues from it with --resume"
        )

    def __str__(self) -> str:
        return self.text


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it carries: its cause, its context, and the per-rank failures of
    torch.distributed.checkpoint's CheckpointException ({rank: (exception, traceback)})."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]


def free_bytes(path: Path) -> int | None:
    """Space an unprivileged writer has left on the filesystem of ``path`` (or of its nearest
    existing parent: a failed save's directory may be gone); None where none can be read."""
    for place in (Path(path), *Path(path).parents):
        try:
            stat = os.statvfs(place)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize
    return None


def disk_full(exc: BaseException, path: Path, what: str) -> BaseException:
    """``exc`` as a :class:`DiskFull` where a full disk caused it (writing ``what`` at ``path``,
    or at the file its errno names), else ``exc`` itself."""
    if isinstance(exc, DiskFull):
        return exc
    chain = list(_wrapped(exc))
    full = next((e for e in chain if isinstance(e, OSError) and e.errno in FULL_ERRNOS), None)
    if full is not None:
        # the file the error names where it is one being written under ``path`` (shutil.copyfile's
        # error, as DeepSpeed copies a script into its checkpoint, names the file it copied from)
        named = [Path(f) for f in (full.filename, full.filename2) if isinstance(f, str)]
        inside = [f for f in named if f == Path(path) or Path(path) in f.parents]
        return DiskFull(full.errno, inside[0] if inside else path, what, free_bytes(path))
    zip_error = next((e for e in chain if isinstance(e, RuntimeError) and any(m in str(e) for m in ZIP_WRITER)), None)
    free = free_bytes(path)
    if zip_error is not None and free is not None and free < NEARLY_FULL:
        # "[enforce fail at inline_container.cc:672] . unexpected pos 97728 vs 97680": what follows the "] . "
        said = (str(zip_error).strip().splitlines() or [""])[0].rpartition("] . ")[2][:200]
        return DiskFull(None, path, what, free, seen=f"{type(zip_error).__name__}: {said}")
    return exc


def reserve_bytes(run_dir: Path, world_size: int) -> int:
    """Room for a failure's record: the record's text, plus the whole blocks each new file or
    folder takes (the record's temporary file, failures/ and attempt-<n>/, one report per rank and
    the temporary file it is written as)."""
    try:
        block = max(4096, os.statvfs(run_dir).f_frsize)
    except OSError:
        block = 4096
    return RECORD_ROOM + block * (world_size + 4)


def reserve_space(run_dir: Path, world_size: int) -> None:
    """Rank 0, on taking ``run_dir``: write the reserve. A disk without room for it is refused
    (:class:`DiskFull`) before anything of the run is written."""
    path = Path(run_dir) / RESERVE_FILE
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(reserve_bytes(run_dir, world_size)))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        free_space(run_dir)
        full = disk_full(err, path, "the run's space reserve")
        if full is err:
            raise
        raise full from err


def free_space(run_dir: Path) -> None:
    """Delete the reserve: a failing rank before it records the failure (any rank may), and rank 0
    before the last record of a run."""
    # A directory that lets nothing be deleted: the writes that follow say what is wrong.
    with contextlib.suppress(OSError):
        (Path(run_dir) / RESERVE_FILE).unlink(missing_ok=True)
