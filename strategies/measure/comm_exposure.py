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
over windows and the verdict all go into the record.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from analysis.schema import CommExposure, Spread

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


def exposure(windows: list[WindowTimes], step_s: float, check_valid: bool) -> CommExposure:
    """The record's ``comm`` section from the timed windows of a run (``step_s``: its mean step).
    The noise of the difference is half its range over windows, and at least NOISE_FLOOR of the
    step: two methods agree when their median difference lies within it."""
    replica = spread([w.replica_s for w in windows])
    if not check_valid or any(w.blocked_s is None for w in windows):
        return CommExposure(replica=replica, trusted="replica",
                            note=f"replica method only ({ms(replica.median_s)} per step): no independent check on this "
                                 "device or with more than one thread per rank")
    check = spread([w.blocked_s for w in windows])
    differences = [w.replica_s - w.blocked_s for w in windows]
    difference = statistics.median(differences)
    noise = max((max(differences) - min(differences)) / 2, NOISE_FLOOR * step_s)
    agree = abs(difference) <= noise
    both = f"the replica method reads {ms(replica.median_s)} per step, the check {ms(check.median_s)} blocked"
    if agree:
        trusted, note = "replica", f"the methods agree: {both}, within noise ({ms(noise)})"
    elif difference > 0:
        trusted, note = "replica", (
            f"{both}: the {ms(difference)} between them is CPU work on the critical path besides the model's (the backend's "
            "copies, hooks and bookkeeping). Trust the replica for the cost beyond compute, the check for time spent waiting "
            "on communication")
    else:
        trusted, note = "check", (
            f"{both}: a replica figure below the check means the compute baseline ran slower than the training's own "
            f"compute (by {ms(-difference)}, beyond noise of {ms(noise)}); trust the check")
    return CommExposure(replica=replica, check=check, difference_s=difference, noise_s=noise, agree=agree,
                        trusted=trusted, note=note)


def trusted_seconds(comm: CommExposure) -> float:
    """The per-step exposed communication the trusted method reads (median over windows)."""
    chosen = comm.check if comm.trusted == "check" else comm.replica
    return chosen.median_s
