"""The directories a command writes to or reads from, checked before any work starts.

Light on purpose (no torch, no pandas): ``kanscale analyze`` and ``kanscale sweep`` refuse a
wrong directory in a fraction of a second instead of after seconds of imports.
"""

from __future__ import annotations

import os
from pathlib import Path

from kanscale.errors import ConfigError


def check_output_dir(path: str | Path, field: str, purpose: str) -> None:
    """Refuse a directory that cannot be created or written here: a file at it or in its path,
    or a nearest existing directory that this user cannot write."""
    path = Path(path)
    # os.path.exists, not Path.exists: a path below a directory this user cannot search is
    # "not there" rather than a PermissionError; the last parent, "." or "/", exists
    existing = next(p for p in (path, *path.parents) if os.path.exists(p))
    if existing == path and not path.is_dir():
        raise ConfigError(f"{field}: {path} is a file; give a directory {purpose}")
    if not existing.is_dir():
        raise ConfigError(
            f"{field}: {path} cannot be created: {existing} is a file, not a directory; give a directory {purpose}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "it" if existing == path else f"{existing}, where it would be created,"
        raise ConfigError(
            f"{field}: {path} cannot be written: {what} is not writable by this user (read-only); "
            f"give a directory you can write {purpose}, or change the permissions"
        )


def runs_directory(directory: str | Path) -> Path:
    """``directory`` as a Path, or a ConfigError naming it when it is not a directory."""
    directory = Path(directory)
    if not directory.exists():
        raise ConfigError(
            f"{directory}: no such directory; give the directory a sweep or `kanscale train --out` wrote its runs to"
        )
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory; give the directory that holds the run directories")
    return directory
