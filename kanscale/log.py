"""The suite's diagnostics on stderr, through :mod:`logging`, at the level ``-q``/``-v`` choose.

Every module logs through ``log.get(__name__)``, a child of the ``kanscale`` logger, so one handler
and one level govern the CLI and every rank it starts. The level travels to ranks in
``KANSCALE_LOG_LEVEL``: a launcher's child processes inherit the environment, not the CLI's flags.
Messages are printed as written, without a level prefix, except warnings and errors, which a
user should be able to tell apart from progress.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

ROOT = "kanscale"
LEVEL_VARIABLE = "KANSCALE_LOG_LEVEL"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record, not the one at set-up:
    a caller that redirects stderr (pytest's capture, ``contextlib.redirect_stderr``) gets the
    messages."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING and not text.startswith("kanscale:"):
            text = f"kanscale: {record.levelname.lower()}: {text}"
        return text


def get(name: str) -> logging.Logger:
    """The logger of module ``name`` (pass ``__name__``), under the suite's root logger."""
    return logging.getLogger(f"{ROOT}.{name}")


def level_for(verbosity: int) -> int:
    """``-q`` (verbosity -1): warnings and errors only; default: progress too; ``-v``: debug."""
    if verbosity < 0:
        return logging.WARNING
    if verbosity > 0:
        return logging.DEBUG
    return logging.INFO


def configure(verbosity: int | None = None) -> None:
    """Send the suite's records to stderr at the chosen level (from ``KANSCALE_LOG_LEVEL`` when
    ``verbosity`` is None, as in a rank), and export the level for the processes this one starts.
    Calling it again only changes the level."""
    if verbosity is None:
        level = logging.getLevelName(os.environ.get(LEVEL_VARIABLE, "INFO"))
        level = level if isinstance(level, int) else logging.INFO
    else:
        level = level_for(verbosity)
    os.environ[LEVEL_VARIABLE] = logging.getLevelName(level)
    root = logging.getLogger(ROOT)
    root.setLevel(level)
    root.propagate = False
    if not root.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(_Format())
        root.addHandler(handler)
