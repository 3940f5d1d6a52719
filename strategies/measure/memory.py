"""Memory a run measures the same way under every strategy: the host's resident set (and its
peak), and the training's peaks on the host and the device."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux), so the
    peak read later covers training, not whatever the process did before."""
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak then covers the whole process
        Path("/proc/self/clear_refs").write_text("5")


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


class TrainingPeaks:
    """The training's memory peaks, read before every baseline sample and reset after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rss = self.device_bytes = 0

    def reset(self) -> None:
        reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> None:
        self.rss = max(self.rss, peak_rss_bytes())
        if self.device.type == "cuda":
            self.device_bytes = max(self.device_bytes, torch.cuda.max_memory_allocated(self.device))
