"""Turning one run's configuration and its measurements, combined across ranks
(:mod:`strategies.measure.combine`), into its run record (the metrics schema in analysis/records/schema.py).
Nothing here talks to the other ranks."""

from __future__ import annotations

import secrets
import statistics
from datetime import datetime, timezone

import numpy as np
import torch

from analysis.records.schema import (
    BatchInfo,
    CompileInfo,
    MeasurementInfo,
    Memory,
    ModelInfo,
    PrecisionInfo,
    RunRecord,
    StepRecord,
    StrategyInfo,
    TaskInfo,
    Throughput,
    Timings,
    Topology,
)
from kan_models import ParamCount
from strategies.experiment import ExperimentConfig
from strategies.measure.combine import Window
from strategies.measure.comm_exposure import exposure, trusted_seconds, unmeasured
from strategies.measure.environment import environment_info
from strategies.measure.timing import blocked_clock_method
from strategies.runtime.batch_plan import BatchPlan
from strategies.runtime.distributed import DistEnv, device_name
from strategies.sections import MeasurementConfig


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


NAME_BYTES = 255  # what a file system holds per name: a run's folder is named by its id


def new_run_id(cfg: ExperimentConfig, world_size: int) -> str:
    """``NAME-FAMILY-WIDTHS-STRATEGY-pWORLD-STAMP-XXXX``: one experiment file trains many models
    (``--set model...``), and its runs say which (the family is left out where the name says it)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    widths = "x".join(map(str, cfg.model.widths))
    if len(widths) > 24:  # a deep model: its ends and depth
        widths = f"{cfg.model.widths[0]}x{cfg.model.widths[-1]}-{len(cfg.model.widths) - 1}layers"
    model = widths if cfg.model.family in cfg.name else f"{cfg.model.family}-{widths}"
    tail = f"-{model}-{cfg.strategy.label()}-p{world_size}-{stamp}-{secrets.token_hex(2)}"
    return cfg.name[: NAME_BYTES - len(tail)] + tail


def batch_info(cfg: ExperimentConfig, plan: BatchPlan, micro_batch: int, steps_done: int) -> BatchInfo:
    t = cfg.training
    return BatchInfo(
        micro_batch=micro_batch,
        grad_accum=t.grad_accum,
        global_batch=plan.global_batch,
        steps=steps_done,
        epochs=round(plan.epochs_done(steps_done), 6),
        warmup_steps=t.warmup_steps,
        timed_steps=max(0, steps_done - t.warmup_steps),
        loader=t.loader,
        loader_workers=t.loader_workers if t.loader == "dataloader" else 0,
    )


def initial_record(cfg: ExperimentConfig, env: DistEnv, run_id: str, params: ParamCount, batch: BatchInfo) -> RunRecord:
    """The record a run starts with (status ``incomplete``); every rank builds the same one."""
    assert env.mesh is not None  # DistEnv places every rank on a mesh when it is made
    model_options = cfg.model.model_dump(mode="json", exclude={"family", "widths"})
    return RunRecord(
        run_id=run_id,
        name=cfg.name,
        status="incomplete",
        study=cfg.study,
        config_digest=cfg.digest(),
        started_at=now_iso(),
        seed=cfg.training.seed,
        strategy=StrategyInfo(
            name=cfg.strategy.name,
            label=cfg.strategy.label(),
            reference=cfg.strategy.reference,
            options=cfg.strategy.model_dump(mode="json", exclude={"name"}),
            adopted=cfg.training._adopted or None,
        ),
        model=ModelInfo(
            family=cfg.model.family,
            widths=cfg.model.widths,
            options=model_options,
            **{slot: model_options[option] for slot, option in cfg.model.resolution.items()},
            machine_choices=cfg.model.machine_choices(env.device.type),
            params_trainable=params.trainable,
            params_total=params.total,
        ),
        task=TaskInfo(
            name=cfg.task.name,
            label=cfg.task.label,
            goal=cfg.task.goal.name,
            input_dim=cfg.task.input_dim,
            n_train=cfg.task.n_train,
            n_test=cfg.task.n_test,
            preparation=cfg.task.preparation,
        ),
        topology=Topology(
            world_size=env.world_size,
            nodes=env.nodes,
            procs_per_node=env.local_world_size,
            launcher=env.launcher,
            comm_backend=env.comm_backend,
            device_type=env.device.type,
            device_name=device_name(env.device),
            threads_per_rank=torch.get_num_threads(),
            mesh=env.mesh.shape.sizes(),
        ),
        batch=batch,
        environment=environment_info(env),
        precision=PrecisionInfo(setting=cfg.training.precision, mechanism="not started: the backend sets it up"),
        compile=CompileInfo(
            setting=cfg.training.compile, mechanism="not started: the engine compiles", mode=cfg.training.compile_mode
        ),
    )


COMM_METHODS = {
    "replica": "step time - data - compute of an unwrapped replica, sampled after each window on all ranks at once",
    "layerwise": "step time - data - compute of the sharded units one at a time and the optimizer on this rank's "
    "shard, sampled after each window on all ranks at once",
}


def results(
    env: DistEnv,
    steps: list[StepRecord],
    windows: list[Window],
    memory: Memory,
    measurement: MeasurementConfig,
    baseline: str,
) -> dict:
    """The record's measured fields, from numbers already combined across ranks (combine.py).
    ``steps`` are all the run's combined step records (from before a resume too); ``windows`` this
    attempt's timing windows, of which the timed ones give the rates, the compute baseline and
    exposed communication with their spread. ``baseline``: the one that ran (or off)."""
    times = [r.time_s_max for r in steps if r.timed]
    timed = [w for w in windows if w.timed]
    wall, n_steps = sum(w.wall_s for w in timed), sum(w.steps for w in timed)
    step_mean = wall / n_steps
    samples_per_s = sum(w.samples for w in timed) / wall
    rates = [w.samples / w.wall_s for w in timed]
    check_valid = env.device.type == "cpu" and torch.get_num_threads() == 1
    if baseline == "off":
        comm = unmeasured(
            "measurement.baseline off: no compute baseline ran, so this run has no exposed-communication "
            "figure (its rates and memory are measured as ever)"
        )
    else:
        comm = exposure([w.times for w in timed], step_mean, check_valid, communicates=env.world_size > 1)
    exposed = trusted_seconds(comm)
    return {
        "status": "ok",
        "error": None,
        "finished_at": now_iso(),
        "timings": Timings(
            total_s=sum(r.time_s_max for r in steps),
            step_mean_s=step_mean,
            step_p50_s=percentile(times, 50),
            step_p95_s=percentile(times, 95),
            data_s=sum(w.times.data_s * w.steps for w in timed) / n_steps,
            compute_s=None if baseline == "off" else statistics.median(w.times.compute_s for w in timed),
            comm_exposed_s=exposed,
        ),
        "throughput": Throughput(
            samples_per_s=samples_per_s,
            samples_per_s_per_rank=samples_per_s / env.world_size,
            samples_per_s_low=min(rates),
            samples_per_s_high=max(rates),
        ),
        "comm_overhead": None if exposed is None else min(1.0, exposed / step_mean),
        "comm": comm,
        "measurement": MeasurementInfo(
            comm_method=COMM_METHODS.get(baseline, "none: measurement.baseline off"),
            baseline=baseline,
            comm_probe=measurement.comm_probe,
            baseline_steps=0 if baseline == "off" else measurement.baseline_steps,
            check_method=blocked_clock_method() if check_valid and baseline != "off" else None,
            timing=measurement.timing,
            window_steps=measurement.window_steps,
            windows=len(timed),
        ),
        "memory": memory,
        "final_loss": steps[-1].loss,
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0
