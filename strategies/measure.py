"""Measurements every strategy records the same way: step-time statistics and host memory."""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux), so the
    peak read later covers training, not whatever the process did before."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (VmHWM), else since the process started."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """Resident set size now (VmRSS); 0 where the kernel does not say."""
    return _status_bytes("VmRSS") or 0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0
