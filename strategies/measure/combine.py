"""Combining what every rank measured, the collectives the record is built from: each timing
window's step samples (two all-reduces per window), and the memory peaks and model-state bytes at
the end (one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from analysis.records.schema import Memory, ModelStateBytes, StepRecord
from strategies.measure.comm_exposure import WindowTimes
from strategies.measure.memory import TrainingPeaks
from strategies.measure.timing import WindowSample
from strategies.runtime.distributed import DistEnv


@dataclass(frozen=True)
class Window:
    """One timing window, combined across ranks."""

    first_step: int  # 0-based
    timed: bool
    steps: int
    samples: int  # global
    # from the opening synchronize to the last step's end (CPU) or the closing synchronize (GPU), slowest rank
    wall_s: float
    times: WindowTimes


def combine_window(
    env: DistEnv, index: int, first_step: int, window: WindowSample, compute_s: float | None, warmup_steps: int
) -> tuple[list[StepRecord], Window]:
    """Step records and the window summary from every rank's samples of one window (two
    collectives for the whole window). A step's exposed communication on a rank is its time
    beyond data and the compute baseline sampled after the window. Losses and samples are summed
    over the data-parallel replicas: the ranks within one replica (tensor parallel) hold the same.
    ``compute_s`` None (no baseline): the steps have no exposed-communication figure."""
    measured = compute_s is not None
    compute_s = compute_s if compute_s is not None else 0.0
    samples = window.steps
    losses = torch.stack([s.loss_share.double() for s in samples]).cpu().tolist()
    rows = [
        [loss, s.time_s, s.time_s - s.data_s - compute_s, s.samples, s.data_s]
        for loss, s in zip(losses, samples, strict=True)
    ]
    rows.append([compute_s, window.wall_s, float(window.blocked_s is not None), window.blocked_s or 0.0, 0.0])
    table = torch.tensor(rows, dtype=torch.float64, device=env.device)
    summed = env.all_reduce(table.clone(), "sum").cpu().tolist()
    maxed = env.all_reduce(table, "max").cpu().tolist()
    assert env.mesh is not None  # DistEnv places every rank on a mesh when it is made
    world, per_replica = env.world_size, env.mesh.ranks_per_replica
    (compute_sum, _, checked, blocked_sum, _), window_max = summed.pop(), maxed.pop()
    compute = compute_sum / world
    steps = [
        StepRecord(
            step=first_step + n + 1,
            loss=s[0] / per_replica,
            time_s_max=m[1],
            time_s_mean=s[1] / world,
            comm_s_max=m[2] if measured else None,
            comm_s_mean=s[2] / world if measured else None,
            compute_s=compute if measured else None,
            window=index,
            samples=round(s[3] / per_replica),
            timed=first_step + n >= warmup_steps,
        )
        for n, (s, m) in enumerate(zip(summed, maxed, strict=True))
    ]
    n = len(steps)
    times = WindowTimes(
        step_s=sum(s[1] for s in summed) / world / n,
        data_s=sum(s[4] for s in summed) / world / n,
        compute_s=compute if measured else math.nan,
        blocked_s=blocked_sum / world if checked == world else None,
    )
    return steps, Window(
        first_step=first_step,
        timed=first_step >= warmup_steps,
        steps=n,
        samples=sum(r.samples for r in steps),
        wall_s=window_max[1],
        times=times,
    )


def combine_memory(env: DistEnv, peaks: TrainingPeaks, replica_bytes: int, state: ModelStateBytes) -> Memory:
    """The largest of every rank's peaks (less the compute baseline's own replica) and model-state
    bytes (a collective)."""
    local = torch.tensor(
        [
            max(0, peaks.rss - replica_bytes),
            max(0, peaks.device_bytes - replica_bytes),
            replica_bytes,
            state.params,
            state.grads,
            state.optimizer,
            state.master_params,
        ],
        dtype=torch.float64,
    )
    peak_rss, peak_device, replica, *state_max = (
        int(v) for v in env.all_reduce(local.to(env.device), "max").cpu().tolist()
    )
    return Memory(
        peak_device_bytes=peak_device if env.device.type == "cuda" else None,
        peak_rss_bytes=peak_rss,
        replica_bytes=replica,
        model_state=ModelStateBytes(
            **dict(zip(("params", "grads", "optimizer", "master_params"), state_max, strict=True))
        ),
    )
