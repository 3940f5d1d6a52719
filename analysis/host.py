"""What machine a measurement came from, as every record and table names it."""

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
