"""The suite's diagnostics on stderr, through :mod:`logging`, at the level ``-q``/``-v`` choose.

Every module logs through ``log.get(__name__)``, a child of the ``kanscale`` logger, so one handler
and one level govern the CLI and every rank it starts. The level travels to ranks in
``KANSCALE_LOG_LEVEL``: a launcher's child processes inherit the environment, not the CLI's flags.
The handler is installed when this module is imported, at the level the environment names (info
when unset), so the suite's progress reaches stderr whether it is entered through the CLI or
called as a library. Messages are printed as written, without a level prefix, except warnings
and errors, which a user should be able to tell apart from progress.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
    def stream(self, _value: TextIO) -> None:
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


def environment_level() -> int:
    """The level ``KANSCALE_LOG_LEVEL`` names; info when it is unset or names no level."""
    level = logging.getLevelName(os.environ.get(LEVEL_VARIABLE, "INFO"))
    return level if isinstance(level, int) else logging.INFO


def configure(verbosity: int | None = None) -> None:
    """Set the level of the suite's records (from ``KANSCALE_LOG_LEVEL`` when ``verbosity`` is
    None, as in a rank), and export it for the processes this one starts."""
    level = environment_level() if verbosity is None else level_for(verbosity)
    os.environ[LEVEL_VARIABLE] = logging.getLevelName(level)
    logging.getLogger(ROOT).setLevel(level)


@contextmanager
def beside_bar() -> Iterator[None]:
    """Write the suite's records above a tqdm bar (through ``tqdm.write``) rather than through it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger(ROOT)]):
        yield


def _install() -> None:
    root = logging.getLogger(ROOT)
    root.propagate = False
    root.setLevel(environment_level())
    handler = _CurrentStderr()
    handler.setFormatter(_Format())
    root.addHandler(handler)


if not logging.getLogger(ROOT).handlers:
    _install()
