"""A run directory belongs to the one run that holds its lock.

Rank 0 of a run takes an advisory lock (``fcntl.flock``) on ``RUN_DIR/.lock`` before it writes
anything there, a new run and a resumed one alike, and holds it until the run's record is final.
A second run that wants the directory (two ``--resume`` of the same run, or a resume of a run
still going) is refused, with the owner the lock file names: its host, pid and start time.

The kernel releases a flock when its holder's process ends, however it ends (kill -9 included),
so a lock is never left behind by a dead run. What can be left behind is the owner's name in the
file: a run that ends normally empties it, one that is killed does not. A run that takes the lock
and finds a name there says that it took over from a run that did not end cleanly. A lock still
held although its recorded owner has ended on this host is held by a process that owner started
and that inherited it, or, on a network filesystem, by a server that has not yet noticed the
client died (NFS releases a dead client's locks after its lease, about 90 s); the refusal says so.

Network filesystems: NFSv4 and Lustre or GPFS mounted with flock support lock across nodes; a
filesystem without it (Lustre mounted ``noflock``, some FUSE ones) fails the call: the run then
goes on with a warning, refused only if the owner recorded in the file still runs on this host,
since refusing outright would make such filesystems unusable.

The mechanism is :class:`DirectoryLock`'s; a subclass names its lock file and its holder:
:class:`RunLock` for a run directory, ``SweepLock`` (launchers/studies/sweep.py) for a sweep's
output directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, ClassVar, TypeVar

from kanscale import log
from kanscale.errors import ConfigError

logger = log.get(__name__)

LOCK_FILE = ".lock"
_Lock = TypeVar("_Lock", bound="DirectoryLock")  # the subclass acquire() is called on


def _owner_alive(owner: dict[str, Any]) -> bool | None:
    """Whether the recorded owner still runs: None where this host cannot tell (another host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return None
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's process
    return True


def _describe(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started {owner.get('since', '?')}"


def _read_owner(file: IO[str]) -> dict[str, Any] | None:
    file.seek(0)
    try:
        owner = json.loads(file.read() or "null")
    except ValueError:
        return None  # torn by a kill mid-write, or not ours
    return owner if isinstance(owner, dict) else None


class DirectoryLock:
    """A process's hold on a directory; :meth:`release` (or the process ending) lets it go."""

    FILE: ClassVar[str]  # the lock file, in the directory
    HOLDER: ClassVar[str]  # what holds it: "run", "sweep"
    OWNS: ClassVar[str]  # what one holder at a time owns, in the refusal: "a run directory"
    INSTEAD: ClassVar[str]  # what else to do than wait, after "wait for that {HOLDER} to end or stop it, "

    def __init__(self, file: IO[str]) -> None:
        self._file: IO[str] | None = file

    @classmethod
    def _refusal(cls, directory: Path, owner: dict[str, Any] | None) -> ConfigError:
        path, holder = directory / cls.FILE, cls.HOLDER
        if owner is None:
            return ConfigError(
                f"{directory} is in use by another {holder} that is just starting (its lock {path} is "
                f"held); wait for that {holder} to end or stop it, {cls.INSTEAD}"
            )
        if _owner_alive(owner) is False:
            return ConfigError(
                f"{directory} is locked ({path}) on behalf of a {holder} that has ended ({_describe(owner)}): "
                "a process it started still holds the lock, or a network filesystem has not released it "
                f"yet (about 90 s); `fuser -v {path}` shows who holds it here; stop it, {cls.INSTEAD}"
            )
        return ConfigError(
            f"{directory} is in use by another {holder} ({_describe(owner)}); one {holder} at a time owns "
            f"{cls.OWNS}: wait for that {holder} to end or stop it, {cls.INSTEAD}"
        )

    @classmethod
    def acquire(cls: type[_Lock], directory: Path) -> _Lock:
        """Take the directory's lock or refuse (:class:`ConfigError` naming the owner). Opening
        the lock file creates it if needed; nothing else in the directory is touched."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / cls.FILE
        try:
            file = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+")
        except OSError as err:
            raise ConfigError(
                f"{path}: cannot open the {cls.HOLDER}'s lock file ({err.strerror}); the directory must be "
                f"writable by whoever runs the {cls.HOLDER}"
            ) from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                logger.warning(
                    f"{path}: this filesystem does not lock files ({err.strerror}); only a "
                    f"{cls.HOLDER} recorded there and still running on this host stops a second one"
                )
                locked = False
            else:
                owner = _read_owner(file)
                file.close()
                raise cls._refusal(directory, owner) from None
        previous = _read_owner(file)
        if previous is not None and not locked and _owner_alive(previous):
            file.close()
            raise cls._refusal(directory, previous)
        if previous is not None:
            logger.warning(
                f"kanscale: {directory}: took over the lock of an earlier {cls.HOLDER} that did not end cleanly "
                f"({_describe(previous)}), which no longer holds it"
            )
        file.seek(0)
        file.truncate()
        file.write(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                }
            )
            + "\n"
        )
        file.flush()
        return cls(file)

    def release(self) -> None:
        """Empty the owner's name (a clean end leaves none) and let the lock go."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
        finally:
            self._file.close()  # closing the file releases the flock
            self._file = None


class RunLock(DirectoryLock):
    """rank 0's hold on a run directory."""

    FILE, HOLDER, OWNS, INSTEAD = LOCK_FILE, "run", "a run directory", "then run again"
