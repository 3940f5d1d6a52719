"""Everything about an experiment that can be checked before a process starts. ``kanscale run``
calls this for the world size it is about to launch; every rank calls it again at start."""

from __future__ import annotations

from pathlib import Path

import torch

from kanscale.errors import ConfigError
from strategies.data import BatchPlan
from strategies.experiment import ExperimentConfig
from strategies.probes import PROBES
from strategies.registry import STRATEGIES


def preflight(cfg: ExperimentConfig, device_type: str, world_size: int) -> BatchPlan:
    """Every problem that can be found before a process starts: the strategy's own checks, the
    batch split at this world size, the step count, the output directory, files it needs."""
    if device_type == "cuda" and not torch.cuda.is_available() and cfg.runtime.device == "cuda":
        raise ConfigError("runtime.device: cuda was asked for but this machine has no CUDA device; set runtime.device=cpu or auto")
    cfg.strategy.preflight(cfg.training, device_type, world_size)
    t = cfg.training
    plan = BatchPlan(cfg.task.n_train, t.micro_batch_for(world_size) * t.grad_accum * world_size, t.seed, t.epochs, t.steps)
    if plan.total_steps <= t.warmup_steps:
        raise ConfigError(
            f"training.warmup_steps: {t.warmup_steps} warm-up steps leave none of the {plan.total_steps} steps to time; "
            "lower warmup_steps or train longer (training.epochs / training.steps)")
    probe = cfg.measurement.comm_probe
    if probe != "none" and probe not in cfg.strategy.probes:
        supporting = ", ".join(name for name, cls in STRATEGIES.items() if probe in cls.probes)
        raise ConfigError(f"measurement.comm_probe: strategy {cfg.strategy.label()} does not support the {probe} probe "
                          f"({PROBES[probe]}); use strategy {supporting} or set measurement.comm_probe=none")
    if t.init_from is not None and not Path(t.init_from).is_file():
        raise ConfigError(f"training.init_from: {t.init_from} does not exist; give a file written by kanscale export")
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; give a directory for the run records")
    return plan
