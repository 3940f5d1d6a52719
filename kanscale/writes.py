"""Writing files where someone else may have put something first. Every file the suite writes in
a folder a user or another account can write to is replaced (a new file beside it, renamed over
it) or appended to without following a link: a symbolic link planted at a report's, a record's or
a log's name is never written through."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import IO, Any

from kanscale.errors import ConfigError


def new_temp_file(path: Path) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path``. Created with mode 0666 like every other file a
    run writes (``open``, ``torch.save``), so the umask (or the directory's default ACL) sets its
    permissions: a group sharing a results directory reads all of it. ``tempfile.mkstemp`` would
    make it 0600, whatever the umask. ``O_EXCL`` creates it or fails: never through a link."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue  # 48 random bits taken: draw again


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a reader sees the old file or the new one, and a
    link at ``path`` is replaced, not followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8 (whatever the locale)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def open_to_append(path: str | Path, binary: bool = False) -> IO[Any]:
    """``path`` opened to append (created where missing), refusing a symbolic link at it by name."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; kanscale does not write through a link it did not make: remove it "
                "(or choose another output folder)"
            ) from None
        raise
    return os.fdopen(fd, "ab" if binary else "a", **({"buffering": 0} if binary else {"encoding": "utf-8"}))
