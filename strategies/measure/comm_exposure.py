"""Exposed communication from two independent methods, and what to make of them.

Per timing window, averaged over ranks:

- the **replica** method: step time - data time - the compute baseline's time sampled right
  after the window (strategies/measure/baseline.py). It counts everything a step does beyond the model's
  own arithmetic: collectives that did not overlap with compute, waiting for slower ranks, and
  the backend's CPU work on the critical path (flattening, copies, hooks);
- the **check**, on CPUs with one thread per rank: the time the main thread neither ran nor
  waited for a core, i.e. was blocked (in a collective, on a slower rank). CPU work of the
  backend is busy time here, so the check is the waiting alone.

So replica - check = the backend's CPU work + the baseline's error, and a replica figure below
the check (beyond noise) can only mean the baseline ran slower than the training's own
compute: the check is then the one to trust. Nothing is clamped: the raw figures, their spread
over windows and the verdict all go into the record; but a method whose median is below zero
measured nothing (no time is negative), so it is never the run's figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from analysis.records.schema import CommExposure, Spread

# Below this share of the step a difference between the methods is not worth a word, however
# steady: scheduler slices and timer reads are of that order.
NOISE_FLOOR = 0.02


@dataclass(frozen=True)
class WindowTimes:
    """One timed window's per-step means, averaged over ranks."""

    step_s: float
    data_s: float
    compute_s: float
    blocked_s: float | None

    @property
    def replica_s(self) -> float:
        return self.step_s - self.data_s - self.compute_s


def spread(values: list[float]) -> Spread:
    return Spread(median_s=statistics.median(values), low_s=min(values), high_s=max(values))


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def exposure(windows: list[WindowTimes], step_s: float, check_valid: bool, communicates: bool = True) -> CommExposure:
    """The record's ``comm`` section from the timed windows of a run (``step_s``: its mean step).
    The noise of the difference is half its range over windows, and at least NOISE_FLOOR of the
    step: two methods agree when their median difference lies within it. ``communicates``: false
    for one process, whose figure is then overhead beyond compute, not communication.

    A method whose median reads below zero measured nothing: no time can be negative, so the
    reading is the method's error (a baseline slower than the training, clocks read under load).
    It is named in the note as such, and never becomes the run's figure: the other method is
    trusted where it reads a time, else the run has none (``trusted: none``)."""
    comm = _compare(windows, step_s, check_valid)
    if not communicates:
        comm = comm.model_copy(
            update={
                "note": f"one process, so no communication: what is measured is overhead beyond "
                f"compute (the loop's own work and the baseline's error). {comm.note}"
            }
        )
    return comm


def _compare(windows: list[WindowTimes], step_s: float, check_valid: bool) -> CommExposure:
    replica = spread([w.replica_s for w in windows])
    blocked = [w.blocked_s for w in windows if w.blocked_s is not None]
    check = spread(blocked) if check_valid and len(blocked) == len(windows) else None
    floor = NOISE_FLOOR * step_s
    negative = [
        f"the {name} method read {ms(s.median_s)} per step, "
        + (
            f"zero within noise ({ms(floor)})"
            if s.median_s >= -floor
            else "less than nothing beyond noise: that is its error on this machine, not a measurement"
        )
        for name, s in (("replica", replica), ("check", check))
        if s is not None and s.median_s < 0
    ]
    if check is not None and check.median_s < 0:
        check = None
    if check is None:
        if replica.median_s < 0:
            return CommExposure(replica=replica, trusted="none", note="; ".join(negative) + ": no figure for this run")
        why = (negative or ["no independent check on this device or with more than one thread per rank"])[0]
        return CommExposure(
            replica=replica, trusted="replica", note=f"replica method only ({ms(replica.median_s)} per step): {why}"
        )
    differences = [w.replica_s - b for w, b in zip(windows, blocked, strict=True)]
    difference = statistics.median(differences)
    noise = max((max(differences) - min(differences)) / 2, NOISE_FLOOR * step_s)
    agree = abs(difference) <= noise
    both = f"the replica method reads {ms(replica.median_s)} per step, the check {ms(check.median_s)} blocked"
    if replica.median_s < 0:
        trusted, note = (
            "check",
            f"{negative[0]}; the check reads {ms(check.median_s)} blocked per step: trust the check",
        )
    elif agree:
        trusted, note = "replica", f"the methods agree: {both}, within noise ({ms(noise)})"
    elif difference > 0:
        trusted, note = (
            "replica",
            (
                f"{both}: the {ms(difference)} between them is CPU work on the critical path besides the model's "
                "(the backend's copies, hooks and bookkeeping). Trust the replica for the cost beyond compute, the "
                "check for time spent waiting on communication"
            ),
        )
    else:
        trusted, note = (
            "check",
            (
                f"{both}: a replica figure below the check means the compute baseline ran slower than the "
                f"training's own compute (by {ms(-difference)}, beyond noise of {ms(noise)}); trust the check"
            ),
        )
    return CommExposure(
        replica=replica, check=check, difference_s=difference, noise_s=noise, agree=agree, trusted=trusted, note=note
    )


def unmeasured(note: str) -> CommExposure:
    """The ``comm`` section of a run that measured no compute baseline (``note`` says why)."""
    return CommExposure(trusted="none", note=note)


def trusted_seconds(comm: CommExposure) -> float | None:
    """The per-step exposed communication the trusted method reads (median over windows); None
    where no method measured it."""
    chosen = {"check": comm.check, "replica": comm.replica}.get(comm.trusted)
    return None if chosen is None else chosen.median_s
