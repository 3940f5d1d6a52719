"""What ranks sharing one machine's cores do to compute, as ``kanscale commbench`` measured it (its
``shared_cores`` rows, CPU ranks on one node): the same work on every rank at once, each step ended
by a collective, against the work on one rank alone. Two things slow it that a one-rank probe cannot
see: the ranks (and their launcher) compete for the cores, and at every collective the first rank
to arrive waits for the last. The slowdown depends on how long a step computes (a short step is
more often caught by another process's time slice), so it is read at the step's own length."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SharedCores:
    """Compute at P ranks per compute alone, at one step length: the mean and its range."""

    factor: float
    low: float
    high: float
    compute_s: float  # the step's compute alone, where it was read

    def words(self, ranks: int, source: str) -> str:
        return (
            f"compute: as measured here on one rank, x{self.factor:.2f} [{self.low:.2f}-{self.high:.2f}] when "
            f"{ranks} ranks share this machine's cores at {1e3 * self.compute_s:.3g} ms of compute per step "
            f"(measured by kanscale commbench in {source}: the same work on every rank at once, each step "
            "ended by an all-reduce, against one rank alone; mean [range over the run]); measured"
        )


def shared_cores_at(docs: Sequence[dict[str, Any]], compute_s: float) -> SharedCores | None:
    """The commbench documents' shared-cores factor at ``compute_s`` seconds of compute per step,
    interpolated in log(seconds) between the lengths measured and held at the ends; None where no
    document measured it (GPU ranks, several nodes, or a file from before the measurement)."""
    rows = sorted((r for d in docs for r in d.get("shared_cores") or ()), key=lambda r: r["compute_s"])
    if not rows:
        return None
    at = min(max(compute_s, rows[0]["compute_s"]), rows[-1]["compute_s"])
    upper = next(i for i, r in enumerate(rows) if r["compute_s"] >= at)
    lower = max(0, upper - 1)
    a, b = rows[lower], rows[upper]
    span = math.log(b["compute_s"]) - math.log(a["compute_s"])
    w = (math.log(at) - math.log(a["compute_s"])) / span if span > 0 else 1.0

    def read(key: str) -> float:
        return (1 - w) * a[key] + w * b[key]

    return SharedCores(read("factor"), read("factor_low"), read("factor_high"), compute_s)
