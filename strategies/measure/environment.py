"""Software and hardware a run used, for its record."""

from __future__ import annotations

import os
import platform
from importlib import metadata

import torch

from analysis.records.schema import Environment
from strategies.runtime.distributed import DistEnv, hostname


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_info(env: DistEnv) -> Environment:
    """Collected on every rank (host names are gathered, so every rank must call this)."""
    return Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        deepspeed=package_version("deepspeed"),
        accelerate=package_version("accelerate"),
        pykan=package_version("pykan"),
        platform=platform.platform(),
        hosts=sorted(set(hosts := env.gather_strings(hostname()))),
        rank_hosts=hosts,
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        gpu_model=torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None,
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
    )
