"""Libraries' deprecation notices, one line per kind per run.

DeepSpeed calls torch collectives that torch has deprecated (``all_gather_into_tensor``,
``reduce_scatter_tensor``), and torch says so with a FutureWarning at every call once the
warnings registry is reset, which any ``warnings.catch_warnings()`` does: a 25-step ZeRO-3 run
printed 102 of them, two lines each. They tell a user of the suite nothing a run can act on, so
each kind (category and text) is shown once, on one line, by the rank that reports (every rank
holds the same libraries). Warnings of every other category, the suite's own among them
(``UncheckedDeepSpeedKeys``, ``ThreadsBeyondCores``), are shown as before.
"""

from __future__ import annotations

import os
import warnings

DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def show_deprecations_once() -> None:
    """Install the filter in this process (again: no effect). Ranks started from it install it
    themselves: every rank runs the suite's entry point."""
    shown_before = warnings.showwarning
    if getattr(shown_before, "deprecations_once", False):
        return
    seen: set[tuple[type[Warning], str]] = set()
    reports = os.environ.get("RANK", "0") == "0"  # what every launcher sets; unset: one process

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, DEPRECATIONS):
            shown_before(message, category, filename, lineno, file, line)
            return
        kind = (category, str(message))
        if reports and kind not in seen:
            seen.add(kind)
            shown_before(message, category, filename, lineno, file, line="")  # "": without the source line

    showwarning.deprecations_once = True
    warnings.showwarning = showwarning
