"""Warnings the suite shows: each kind once per launch, on one line, without a source path.

Two kinds of warning are shown this way. The suite's own (``ThreadsBeyondCores``,
``UncheckedDeepSpeedKeys``: categories defined in its packages) come from checks that run in the
launcher and again in every rank, since a rank may be started without the suite's launcher; shown
as Python shows them, the same advice would appear once from each process, two lines each, one
of them a path into the suite a user has no reason to open. Libraries' deprecation notices
(DeepSpeed calls torch collectives that torch has deprecated) are shown by torch at every call
once the warnings registry is reset, which any ``warnings.catch_warnings()`` does, and tell a
user of the suite nothing a run can act on.

A third kind is a library's warning the suite can explain: DDP's "Grad strides do not match bucket
view strides", which pykan's layers cause at every step of every rank (their gradients are laid
out unlike their parameters in dimensions of size 1, where any stride addresses the same memory).
It is shown once per launch, by the reporting rank, as what it means for the run.

So each kind (category and text) goes through the suite's logger as a warning, once: a process
records the kinds it has shown in ``KANSCALE_WARNINGS_SHOWN``, which the processes it starts
inherit and do not repeat. Deprecations are shown by the rank that reports only (every rank holds
the same libraries). Warnings of every other category are shown as Python shows them.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from typing import TextIO

from kanscale import log

logger = log.get(__name__)

SUITE_PACKAGES = frozenset({"kanscale", "kan_models", "strategies", "launchers", "analysis"})
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
SHOWN_VARIABLE = "KANSCALE_WARNINGS_SHOWN"
EXPLAINED = {
    "Grad strides do not match bucket view strides": (
        "DDP: some gradients are laid out unlike their parameters (pykan's, in dimensions of size 1, where "
        "any stride addresses the same memory); DDP copies each into its bucket, one copy per step that "
        "changes no value (torch's warning for it, shown once here)"
    ),
}


def is_suites(category: type[Warning]) -> bool:
    """Whether ``category`` is defined in one of the suite's packages."""
    return category.__module__.partition(".")[0] in SUITE_PACKAGES


def kind(category: type[Warning], message: Warning | str) -> str:
    """A short, stable name of a warning's kind, fit for an environment variable."""
    return hashlib.sha256(f"{category.__name__}: {message}".encode()).hexdigest()[:16]


def show_once(category: type[Warning], message: Warning | str) -> None:
    """Log the warning unless this process or the one that started it has shown its kind."""
    shown = os.environ.get(SHOWN_VARIABLE, "").split()
    name = kind(category, message)
    if name in shown:
        return
    os.environ[SHOWN_VARIABLE] = " ".join([*shown, name])
    logger.warning("%s: %s", category.__name__, message)


class _ShowOnce:
    """``warnings.showwarning`` for the suite: the kinds above once, the others as before."""

    def __init__(self, shown_before: Callable[..., None]) -> None:
        self.shown_before = shown_before
        self.reports = os.environ.get("RANK", "0") == "0"  # what every launcher sets; unset: one process

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        explained = next((words for start, words in EXPLAINED.items() if str(message).startswith(start)), None)
        if is_suites(category):
            show_once(category, message)
        elif explained is not None:
            if self.reports:
                show_once(category, explained)
        elif not issubclass(category, DEPRECATIONS):
            self.shown_before(message, category, filename, lineno, file, line)
        elif self.reports:
            show_once(category, message)


def show_warnings_once() -> None:
    """Install the filter in this process (again: no effect). Ranks started from it install it
    themselves: every rank runs the suite's entry point."""
    if not isinstance(warnings.showwarning, _ShowOnce):
        warnings.showwarning = _ShowOnce(warnings.showwarning)
