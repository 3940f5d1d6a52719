"""The learning rate of each optimizer step under ``training.schedule``: one function of the step,
which the training loop sets on every backend's optimizer before the step, so that every strategy
steps with the same learning rate and a resumed run continues the schedule exactly (it depends on
the step number alone: nothing to checkpoint).

The formulas are DeepSpeed's (deepspeed/runtime/lr_schedules.py: WarmupLR, WarmupDecayLR,
WarmupCosineLR) including when DeepSpeed applies them: its engine steps the scheduler after each
optimizer step, starting from ``last_batch_iteration = -1``, so optimizer step k (1-based) runs
with the scheduler's value at iteration k - 2, the first two steps both at the warm-up's start.
``tests/test_schedule.py`` checks every step against DeepSpeed's own classes."""

from __future__ import annotations

import math

import torch

from strategies.sections import ScheduleConfig, TrainingConfig

# DeepSpeed warms up over at least this many steps (``max(2, warmup_num_steps)``), so that log(W) > 0
MIN_WARMUP = 2


def warmup_steps(schedule: ScheduleConfig, total_steps: int) -> int:
    """The warm-up length a schedule runs with in a run of ``total_steps`` optimizer steps."""
    given = schedule.warmup_steps if schedule.warmup_steps is not None else math.ceil(total_steps / 10)
    return max(MIN_WARMUP, given)


def _warmup_fraction(schedule: ScheduleConfig, iteration: int, warmup: int) -> float:
    if schedule.warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup)
    return iteration / warmup


def lr_at(training: TrainingConfig, step: int, run_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the steps already taken) in a run of
    ``run_steps`` steps."""
    schedule, peak = training.schedule, training.lr
    if schedule.name == "constant":
        return peak
    total = schedule.total_steps or run_steps
    warmup = warmup_steps(schedule, total)
    iteration = step - 1  # DeepSpeed's last_batch_iteration when it steps the optimizer for the step-th time
    if schedule.name == "warmup_cosine":
        return peak * _cosine_ratio(schedule, iteration, warmup, total)
    low = schedule.warmup_min_lr
    if iteration < 0:
        return low
    if iteration < warmup:
        gamma = _warmup_fraction(schedule, iteration, warmup)
    elif schedule.name == "warmup":
        gamma = 1.0
    else:  # warmup_decay
        gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
    return low + (peak - low) * gamma


def _cosine_ratio(schedule: ScheduleConfig, iteration: int, warmup: int, total: int) -> float:
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        start = schedule.warmup_min_ratio
        return start + _warmup_fraction(schedule, iteration, warmup) * (1.0 - start)
    progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
    end = schedule.cos_min_ratio
    return max(0.0, end + (1.0 - end) * (1 + math.cos(math.pi * progress)) / 2)


def innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that updates the parameters, inside Accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Step ``optimizer`` (or the one it wraps) with ``lr`` from now on."""
    for group in innermost(optimizer).param_groups:
        group["lr"] = lr


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate ``optimizer`` (or the one it wraps) steps with, read from it."""
    return float(innermost(optimizer).param_groups[0]["lr"])
