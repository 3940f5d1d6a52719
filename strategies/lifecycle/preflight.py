"""Everything about an experiment that can be checked before a process starts. ``kanscale run``
calls this for the world size it is about to launch; every rank calls it again at start."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kan_models.tasks.contract import TaskConfig
from kanscale.directories import check_output_dir
from kanscale.errors import ConfigError
from strategies.experiment import ExperimentConfig
from strategies.measure.probes import PROBES
from strategies.registry import STRATEGIES
from strategies.runtime.batch_plan import BatchPlan
from strategies.runtime.mesh import MeshShape
from strategies.sections import TrainingConfig
from strategies.step.precision_support import check_precision_support


class ThreadsBeyondCores(UserWarning):
    """More torch threads on a machine than it has cores: the ranks compete for them."""


@dataclass(frozen=True)
class Machines:
    """Where a launch's ranks run: ``count`` machines, ``ranks_here`` ranks on each. Their memory
    and cores are checked as this machine's unless ``like_this_one`` is false (a SLURM launch,
    checked on a login node; every rank checks again on its own node)."""

    count: int
    ranks_here: int
    like_this_one: bool = True

    @classmethod
    def from_environ(cls, world_size: int) -> Machines:
        """A rank's view: torchrun, accelerate and deepspeed export LOCAL_WORLD_SIZE (the ranks
        on this machine); a process started by hand is alone."""
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        return cls(count=max(1, world_size // ranks_here), ranks_here=ranks_here)


def preflight(
    cfg: ExperimentConfig,
    device_type: str,
    world_size: int,
    machines: Machines | None = None,
    ranks_per_node: int | None = None,
) -> BatchPlan:
    """Every problem that can be found before a process starts: the strategy's own checks, its
    mesh at this world size, the batch split over it, the step count, the model's memory, the
    output directory, files it needs. ``machines``: where the ranks run (default:
    :meth:`Machines.from_environ`); ``ranks_per_node``: the launch's (default: ``machines``')."""
    check_device(cfg, device_type)
    check_precision_support(
        cfg.training.precision, device_type, cfg.strategy.label(), cfg.strategy.missing_precision_support
    )
    cfg.strategy.preflight(cfg.training, device_type, world_size)
    machines = machines or Machines.from_environ(world_size)
    mesh = cfg.strategy.mesh_shape(world_size, ranks_per_node or machines.ranks_here)
    t = cfg.training
    shares = mesh.dp  # the world size, but for tensor parallelism
    plan = BatchPlan(cfg.task.n_train, t.micro_batch_for(shares) * t.grad_accum * shares, t.seed, t.epochs, t.steps)
    check_batch_fits_data(t, cfg.task, shares, plan.global_batch)
    if plan.total_steps <= t.warmup_steps:
        raise ConfigError(
            f"training.warmup_steps: {t.warmup_steps} warm-up steps leave none of the {plan.total_steps} steps to "
            "time; lower warmup_steps or train longer (training.epochs / training.steps)"
        )
    check_schedule_fits_run(t, plan.total_steps)
    probe = cfg.measurement.comm_probe
    if probe != "none" and probe not in cfg.strategy.probes:
        supporting = ", ".join(name for name, cls in STRATEGIES.items() if probe in cls.probes)
        raise ConfigError(
            f"measurement.comm_probe: strategy {cfg.strategy.label()} does not support the {probe} probe "
            f"({PROBES[probe]}); use strategy {supporting} or set measurement.comm_probe=none"
        )
    check_compile(cfg, device_type)
    check_baseline(cfg, mesh)
    if t.grid_update_every and not cfg.model.refits_grids():
        raise ConfigError(
            f"training.grid_update_every: a {cfg.model.family} model has no grids to refit (only spline "
            "KANs do: bspline, pykan, or a custom model with update_grid); set training.grid_update_every=0"
        )
    if t.init_from is not None and not Path(t.init_from).is_file():
        raise ConfigError(f"training.init_from: {t.init_from} does not exist; give a file written by kanscale export")
    check_output_dir(cfg.output.dir, "output.dir", "for the run records")
    if machines.like_this_one:
        check_memory(cfg, device_type, machines.count)
        check_threads(cfg.runtime.threads, machines.ranks_here)
    cfg.model.check_shape(
        cfg.task.name, cfg.task.input_dim, cfg.task.output_dim
    )  # after the memory check: it may build
    return plan


def check_baseline(cfg: ExperimentConfig, mesh: MeshShape) -> None:
    """The layerwise baseline times eager units of a whole layer each (strategies/measure/layerwise.py)."""
    if cfg.measurement.baseline != "layerwise":
        return
    if cfg.training.compile != "none":
        raise ConfigError(
            f"measurement.baseline: layerwise times the units eagerly, but training.compile is "
            f"{cfg.training.compile}, so it would not time what the run computes; set "
            "measurement.baseline=replica (or off), or training.compile=none"
        )
    if mesh.tp > 1:
        raise ConfigError(
            f"measurement.baseline: layerwise times whole layers, but {cfg.strategy.label()} cuts each "
            "layer over tensor-parallel ranks; set measurement.baseline=replica (its replica is already "
            "this rank's part of each layer) or off"
        )


def check_device(cfg: ExperimentConfig, device_type: str) -> None:
    if device_type == "cuda" and not torch.cuda.is_available() and cfg.runtime.device == "cuda":
        raise ConfigError(
            "runtime.device: cuda was asked for but this machine has no CUDA device; set runtime.device=cpu or auto"
        )


def check_compile(cfg: ExperimentConfig, device_type: str) -> None:
    t = cfg.training
    if t.compile == "step" and not cfg.strategy.compiles_step:
        supporting = ", ".join(name for name, cls in STRATEGIES.items() if cls.compiles_step)
        raise ConfigError(
            f"training.compile: step compiles the whole step under strategy {supporting} only, not "
            f"{cfg.strategy.label()} (DeepSpeed and Accelerate run their own backward and optimizer "
            "step); use one of those strategies, or training.compile=model"
        )
    if t.compile == "model" and not cfg.strategy.compiles_model:
        raise ConfigError(
            f"training.compile: model is not run under strategy {cfg.strategy.label()} (its layers run "
            "through DTensor's local_map, which the suite has not compiled); set training.compile=none"
        )
    if t.compile_mode in ("reduce-overhead", "max-autotune") and device_type != "cuda":
        raise ConfigError(
            f"training.compile_mode: {t.compile_mode} captures CUDA graphs, which a {device_type} run has "
            "none of; use compile_mode default (or max-autotune-no-cudagraphs)"
        )


def check_batch_fits_data(t: TrainingConfig, task: TaskConfig, shares: int, step: int) -> None:
    """Refuse a step (``step`` samples over all ``shares`` data-parallel ranks) larger than the
    training set: it would train on the whole set while the record reported the larger batch."""
    n_train, accum_x_ranks = task.n_train, t.grad_accum * shares
    if step <= n_train:
        return
    sizes = (
        f"a step takes {t.micro_batch_for(shares)} samples per rank x grad_accum {t.grad_accum} x {shares} "
        f"data-parallel rank(s) = {step}, but the task's training split has {n_train}"
    )
    if n_train < accum_x_ranks:
        raise ConfigError(f"task: {sizes}, fewer than one per rank and micro-step; {more_data(task, accum_x_ranks)}")
    field, most = (
        ("training.micro_batch", n_train // accum_x_ranks)
        if t.micro_batch is not None
        else ("training.global_batch", n_train // accum_x_ranks * accum_x_ranks)
    )
    raise ConfigError(f"{field}: {sizes}; lower {field} to at most {most}, or {more_data(task, step)}")


def more_data(task: TaskConfig, samples: int) -> str:
    """How to give ``task`` a training split of ``samples``: its own size field where it has one,
    else a smaller test share of its table (a file or a bundled dataset has the rows it has)."""
    if "n_train" in type(task).model_fields:
        return f"raise task.n_train to at least {samples}"
    rows = task.n_train + task.n_test
    share = math.floor((rows - samples) / rows * 1000) / 1000  # rounded down: the split then holds them
    if "test_fraction" in type(task).model_fields and share > 0:
        return f"lower task.test_fraction to at most {share} (the table has {rows} rows)"
    return f"give the task a table of more than {samples} rows (it has {rows})"


def optimizer_state_tensors(t: TrainingConfig) -> int:
    """State tensors the optimizer keeps per parameter: Adam and AdamW two moments, SGD one
    momentum buffer when momentum is on."""
    return 2 if t.optimizer in ("adam", "adamw") else int(t.momentum > 0)


def training_state_bytes(cfg: ExperimentConfig) -> int:
    """One copy of what training holds: parameters and buffers, a gradient per trainable
    parameter, the optimizer's state. Sharding strategies spread this one copy over the ranks;
    none makes it smaller (activations come on top)."""
    count = cfg.model.parameter_count()
    element = torch.finfo(getattr(torch, cfg.training.dtype)).bits // 8
    return element * (count.total + count.trainable * (1 + optimizer_state_tensors(cfg.training)))


def machine_memory_bytes(device_type: str) -> int:
    """This machine's memory: its RAM, plus its GPUs' where the ranks run on them."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device_type != "cuda" or not torch.cuda.is_available():
        return ram
    return ram + sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def check_memory(cfg: ExperimentConfig, device_type: str, machines: int) -> None:
    """Refuse a model whose training state exceeds the memory of every machine of the launch
    together (each taken to be like this one): it cannot run under any strategy."""
    need, have = training_state_bytes(cfg), machine_memory_bytes(device_type) * machines
    if need <= have:
        return
    count = cfg.model.parameter_count()
    where = "this machine" if machines == 1 else f"{machines} machines like this one"
    raise ConfigError(
        f"model.widths: {cfg.model.family} {cfg.model.widths} has {count.trainable:,} trainable parameters; training "
        f"it needs about {gib(need)} (the {cfg.training.dtype} parameters, their gradients and "
        f"{cfg.training.optimizer}'s {optimizer_state_tensors(cfg.training)} state tensor(s) per parameter), more than "
        f"the {gib(have)} of memory of {where}; use smaller model.widths (or model.grid), or more machines"
    )


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_threads(threads: int | None, ranks_here: int) -> None:
    """Warn (once, not from every rank) when the ranks on this machine ask for more threads
    than it has cores: they would compete for cores and the timings would mean little."""
    cores = os.cpu_count() or 1
    if threads is None or threads * ranks_here <= cores or os.environ.get("RANK", "0") != "0":
        return
    warnings.warn(
        f"runtime.threads: {threads} thread(s) x {ranks_here} rank(s) on this machine = {threads * ranks_here} "
        f"for its {cores} cores; the ranks will compete for cores and the timings mean little; set "
        f"runtime.threads to at most {max(1, cores // ranks_here)} or leave it unset",
        ThreadsBeyondCores,
        stacklevel=2,
    )


def check_schedule_fits_run(t: TrainingConfig, steps: int) -> None:
    """Refuse settings the run's length contradicts: a learning-rate warm-up the run ends before,
    a linear decay that reaches 0 before the run's last steps, checkpoints the run never reaches."""
    schedule = t.schedule
    if schedule.name != "constant" and schedule.warmup_steps is not None and schedule.warmup_steps >= steps:
        raise ConfigError(
            f"training.schedule.warmup_steps: {schedule.warmup_steps} warm-up steps, but the run trains {steps} "
            f"optimizer steps: it ends before the learning rate reaches training.lr; lower warmup_steps below "
            f"{steps} (null: a tenth of the run) or train longer (training.steps / training.epochs)"
        )
    if schedule.name == "warmup_decay" and schedule.total_steps is not None and schedule.total_steps < steps:
        raise ConfigError(
            f"training.schedule.total_steps: the decay reaches a learning rate of 0 at step {schedule.total_steps}, "
            f"but the run trains {steps} steps: its last {steps - schedule.total_steps} would change nothing; "
            f"set training.schedule.total_steps={steps} (or null: the run's steps)"
        )
    if t.checkpoint_every > steps:
        raise ConfigError(
            f"training.checkpoint_every: every {t.checkpoint_every} steps, but the run trains {steps}: it would "
            f"write no checkpoint; set training.checkpoint_every={steps} (or lower) or 0 for none"
        )
