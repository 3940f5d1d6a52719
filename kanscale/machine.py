"""What machine a measurement came from, as every record and table names it (the record's
``topology.device_name`` on CPUs): kernel rates, crossovers and what a backend supports differ
between CPUs."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
