"""The run's step records: those of the attempts before a resume, then each timing window's as
it is combined over the ranks; rank 0 appends them to steps.jsonl and reports progress as it does.

Every rank keeps the same records (they come out of one collective per window), so a failure on
any rank can write the completed steps that are not yet on disk.
"""

from __future__ import annotations

import math

from analysis.records.run_files import RunWriter
from analysis.records.schema import StepRecord
from strategies.lifecycle.failures import check_finite
from strategies.loop.progress import Progress
from strategies.loop.trackers import Trackers
from strategies.measure.combine import Window


class StepLog:
    """Step records kept, written and reported; ``steps`` starts with the run's earlier steps."""

    def __init__(
        self, steps: list[StepRecord], writer: RunWriter | None, progress: Progress, trackers: Trackers | None = None
    ) -> None:
        self.steps = steps  # the run's steps, from before a resume too
        self.written = len(steps)  # of self.steps, the steps in steps.jsonl
        self.writer = writer  # rank 0's; None on the other ranks
        self.progress = progress
        self.trackers = trackers or Trackers([])  # rank 0's: tracking.report_to
        self.windows: list[Window] = []  # this attempt's timing windows
        self.lrs: dict[int, float] = {}  # this window's learning rates, read from the optimizer, by step

    def first_window_index(self) -> int:
        """The number of this attempt's first window: after those of the steps kept from before."""
        numbered = [s.window for s in self.steps if s.window is not None]
        return max(numbered) + 1 if numbered else 0

    def add_window(self, steps: list[StepRecord], window: Window, steps_done: int) -> None:
        """Keep one combined window's steps, each with the learning rate it ran with; on a
        non-finite loss, write the finite steps before it and raise."""
        steps = [s.model_copy(update={"lr": self.lrs.pop(s.step - 1)}) for s in steps]
        finite = [s for s in steps if math.isfinite(s.loss)]
        self.steps += finite
        if len(finite) < len(steps):
            self.write(steps_done)
            check_finite(steps[len(finite)].loss, steps[len(finite)].step)
        self.windows.append(window)

    def progress_due(self, first: int, end: int) -> bool:
        """Whether progress is reported at one of the steps ``first + 1`` to ``end``."""
        return any(self.progress.due(n) for n in range(first + 1, end + 1))

    def write(self, steps_done: int) -> None:
        """Append the kept step records not yet in steps.jsonl (rank 0 writes; no collective)."""
        records = self.steps[self.written :]
        if not records:
            return
        if self.writer is not None:
            self.writer.append_steps(records)
            self.trackers.log_steps(records)
        self.written = len(self.steps)
        last = records[-1]
        self.progress.update(steps_done, loss=last.loss, samples_per_s=last.samples / max(last.time_s_max, 1e-12))
