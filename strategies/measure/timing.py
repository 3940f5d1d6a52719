"""Timing training steps without changing them.

Real training does not synchronize ranks or the device between steps, so neither does the
clock: the ranks synchronize once per *window* of steps (``measurement.window_steps``), before
its first step and after its last, and in between each step is only stamped. On a CPU a stamp is
a read of the wall clock; on a GPU it is a CUDA event recorded on the stream, read back after the
window's closing synchronize, so one step's kernel launches still overlap the previous step's work
as in training. Collectives inside a step keep the ranks in step with each other, so per-step
times stay comparable across ranks. The main thread's scheduler clocks, for the time it was
blocked, are read once at each end of a window, not of every step: a read is a procfs file and a
system call, cold between steps, and would weigh on a short step (docs/metrics.md).

``measurement.timing: per_step`` brackets every step with a barrier (and a device synchronize)
instead, for studies that need each step's own distribution; it is not the default because it
adds two collectives per step and, on a GPU, removes the overlap between steps.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from strategies.runtime.distributed import DistEnv

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_clock() -> tuple[float, float] | None:
    """Seconds this thread has run on a core and seconds it has waited in the run queue for
    one; None where the kernel does not keep the second (Linux scheduler statistics). The run
    time comes from the thread's CPU clock, exact at any moment; the kernel's own run-time
    counter lags by up to a scheduler tick while the thread runs. The wait only grows while the
    thread is not running, so reading it from the running thread is exact."""
    ran = time.thread_time()  # first: the read below is then inside the interval it measures
    try:
        waited = int(os.pread(_schedstat_fd(), 100, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return ran, waited / 1e9


_FDS: dict[int, int] = {}


def _schedstat_fd() -> int:
    """This thread's scheduler statistics, opened once: a read then costs about a microsecond,
    against some 15 opening the file each time."""
    thread = threading.get_ident()
    if thread not in _FDS:
        _FDS[thread] = os.open(SCHEDSTAT, os.O_RDONLY)
    return _FDS[thread]


def blocked_clock_method() -> str | None:
    """How :class:`WindowSample` ``blocked_s`` is measured here, or None where it cannot be."""
    if thread_clock() is None:
        return None
    return (
        "wall time - main thread's CPU time - its time waiting for a core (/proc/thread-self/schedstat), "
        "over each window's steps, per step"
    )


@dataclass
class StepSample:
    """One rank's measurements of one step, before they are combined across ranks."""

    loss_share: torch.Tensor  # 0-dim, on the device: read once the window is synchronized
    time_s: float
    data_s: float
    samples: int


@dataclass
class WindowSample:
    """One rank's measurements of one window: its steps, its wall time, and the time per step its
    main thread was neither running nor waiting for a core, i.e. blocked, e.g. in a collective
    (None where the clocks say nothing of it: a GPU's work, a kernel without scheduler statistics)."""

    steps: list[StepSample]
    wall_s: float
    blocked_s: float | None


class StepTimer:
    """Stamps the steps of one window at a time on this rank (see the module docstring)."""

    def __init__(self, env: DistEnv, per_step: bool) -> None:
        self.env, self.per_step = env, per_step
        self.cuda = env.device.type == "cuda"
        self._steps: list[dict] = []

    def _stamp(self) -> dict:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return {"event": event}
        # per_step: the thread's clocks at each end of the step, where its barriers between steps
        # are no step's blocking
        return {"wall": time.perf_counter(), "thread": thread_clock() if self.per_step else None}

    def _clocks(self) -> tuple[float, tuple[float, float]] | None:
        """The wall clock and the thread's clocks, at an end of a window (windowed timing on a CPU)."""
        if self.cuda or self.per_step or (thread := thread_clock()) is None:
            return None
        return time.perf_counter(), thread

    def start_window(self) -> None:
        self._steps = []
        self.env.synchronize()
        self._window_clocks = self._clocks()
        self._window_start = time.perf_counter()

    def start_step(self) -> None:
        if self.per_step:
            self.env.synchronize()
        self._steps.append({"start": self._stamp()})

    def data_ready(self) -> None:
        self._steps[-1]["data"] = self._stamp()

    def end_step(self, loss_share: torch.Tensor, samples: int) -> None:
        if self.per_step:
            self.env.synchronize()
        self._steps[-1].update(end=self._stamp(), loss=loss_share, samples=samples)

    def end_window(self) -> WindowSample:
        """Synchronize, then this window's samples and this rank's wall time: from the opening
        synchronize to the end of its last step on a CPU, whose stamp is when the rank's work
        ended (the closing barrier is the clock's own, no step's); to the closing synchronize on a
        GPU, the first time the host knows its queued work is done. Combined across ranks by their
        maximum."""
        clocks = self._clocks()  # before the closing synchronize, whose wait is no step's
        self.env.synchronize()
        end = time.perf_counter() if self.cuda or not self._steps else self._steps[-1]["end"]["wall"]
        return WindowSample([self._sample(s) for s in self._steps], end - self._window_start, self._blocked(clocks))

    def _blocked(self, end: tuple[float, tuple[float, float]] | None) -> float | None:
        """Seconds per step the thread was blocked: over the window (windowed), or its steps (per_step)."""
        if not self._steps:
            return None
        if self.per_step:
            spans = (
                [(s["start"]["wall"], s["start"]["thread"], s["end"]["wall"], s["end"]["thread"]) for s in self._steps]
                if not self.cuda
                else []
            )
        else:
            start = self._window_clocks
            spans = [(start[0], start[1], end[0], end[1])] if start is not None and end is not None else []
        if not spans or any(t0 is None or t1 is None for _, t0, _, t1 in spans):
            return None
        return sum(w1 - w0 - (t1[0] - t0[0]) - (t1[1] - t0[1]) for w0, t0, w1, t1 in spans) / len(self._steps)

    def _sample(self, step: dict) -> StepSample:
        start, data, end = step["start"], step["data"], step["end"]
        if self.cuda:
            elapsed = start["event"].elapsed_time(end["event"]) / 1e3
            data_s = start["event"].elapsed_time(data["event"]) / 1e3
        else:
            elapsed, data_s = end["wall"] - start["wall"], data["wall"] - start["wall"]
        return StepSample(loss_share=step["loss"].detach(), time_s=elapsed, data_s=data_s, samples=step["samples"])


def window_bounds(
    start_step: int, total_steps: int, warmup_steps: int, window_steps: int, also_at: int = 0
) -> list[tuple[int, int]]:
    """The windows of steps ``[first, end)`` (0-based) a run from ``start_step`` goes through:
    warm-up steps form their own windows, so no timed window holds one, and a window also ends
    where a checkpoint is due (``also_at``: every that many steps), so checkpoints, progress
    reports and the compute baseline all fall between windows."""
    bounds, first = [], start_step
    while first < total_steps:
        end = min(total_steps, first + window_steps)
        if first < warmup_steps < end:
            end = warmup_steps
        if also_at:
            end = min(end, (first // also_at + 1) * also_at)
        bounds.append((first, end))
        first = end
    return bounds
