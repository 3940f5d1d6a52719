"""Where the fast B-spline layer's sparse product starts to beat its dense one, on this machine.

The crossover, in bases per non-zero basis ((G + k) / (k + 1)), is the ratio of two kernel rates:
a dense GEMM's and torch's CSR products'. It moves with the CPU (an Intel Xeon with AMX and an AMD
EPYC break even far apart: docs/models.md). So it is measured where it runs:
``python scripts/bench_sparse_crossover.py --save`` stores this CPU's crossover (per CPU model and
torch version) in ``$KANSCALE_CACHE_DIR`` (default ``~/.cache/kanscale``), and ``product: auto``
takes the stored value where there is one, else :data:`DEFAULT`. The run record's model options say
which (``product_auto_from``).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kanscale.machine import cpu_model


@dataclass(frozen=True)
class Crossover:
    bases_per_nonzero: float  # from this many bases per non-zero one, ``auto`` multiplies sparsely
    source: str  # where the number came from, for the record

    def describe(self) -> str:
        return f"{self.bases_per_nonzero:.1f} bases per non-zero ({self.source})"


# Where sparse clearly wins on the Xeon the default was measured on (it breaks even at about half
# of it): a machine that has not measured its own keeps the dense product until the work ratio is large.
DEFAULT = Crossover(
    20.0,
    "default: measured on an Intel Xeon with AMX; measure this CPU's with scripts/bench_sparse_crossover.py --save",
)


def cache_dir() -> Path:
    """What the suite measures or builds once per machine: ``$KANSCALE_CACHE_DIR``, default
    ``~/.cache/kanscale``."""
    return Path(os.environ.get("KANSCALE_CACHE_DIR") or Path.home() / ".cache/kanscale")


def store_path() -> Path:
    return cache_dir() / "sparse_crossover.json"


def machine_key() -> str:
    return f"{cpu_model()} | torch {torch.__version__.split('+')[0]}"


def _stored() -> dict:
    try:
        data = json.loads(store_path().read_text())
    except (OSError, ValueError):
        return {}  # none measured (or unreadable): the default holds
    return data if isinstance(data, dict) else {}


@functools.cache
def cpu_crossover() -> Crossover:
    """This machine's measured crossover where one is stored for its CPU and torch, else :data:`DEFAULT`."""
    entry = _stored().get(machine_key())
    if not isinstance(entry, dict):
        return DEFAULT
    value = entry.get("bases_per_nonzero")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 1 <= value < 1e6:
        return DEFAULT
    return Crossover(
        float(value), f"measured on this CPU ({cpu_model()}) on {entry.get('measured_on', 'an unknown date')}"
    )


def save_crossover(bases_per_nonzero: float, measured_on: str, table: list[dict]) -> Path:
    """Store this machine's crossover (and the measurements it came from) beside other machines'."""
    path = store_path()
    data = _stored()
    data[machine_key()] = {"bases_per_nonzero": round(bases_per_nonzero, 2), "measured_on": measured_on, "table": table}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    cpu_crossover.cache_clear()
    return path


def break_even(points: list[tuple[float, float]]) -> float | None:
    """The bases per non-zero at which dense / sparse time first reaches 1, interpolated between the
    measured ``(bases per non-zero, dense / sparse)`` points on either side; None if sparse never wins
    (the first point if it always does)."""
    points = sorted(points)
    if points and points[0][1] >= 1:
        return points[0][0]
    for (x0, r0), (x1, r1) in itertools.pairwise(points):
        if r1 >= 1:
            return x0 + (1 - r0) / (r1 - r0) * (x1 - x0)
    return None
