"""Turning one run's configuration and measurements into its run record (the metrics schema in
analysis/schema.py)."""

from __future__ import annotations

import secrets
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from analysis.schema import (
    BatchInfo, CompileInfo, MeasurementInfo, Memory, ModelInfo, ModelStateBytes, PrecisionInfo, RunRecord, StepRecord, StrategyInfo,
    TaskInfo, Throughput, Timings, Topology,
)
from kan_models import ParamCount
from strategies.baseline import TrainingPeaks
from strategies.comm_exposure import WindowTimes, exposure, trusted_seconds
from strategies.config import MeasurementConfig
from strategies.data import BatchPlan
from strategies.distributed import DistEnv, device_name
from strategies.environment import environment_info
from strategies.experiment import ExperimentConfig
from strategies.measure import percentile
from strategies.timing import StepSample, blocked_clock_method


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_run_id(cfg: ExperimentConfig, world_size: int) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.name}-{cfg.strategy.label()}-p{world_size}-{stamp}-{secrets.token_hex(2)}"


def batch_info(cfg: ExperimentConfig, plan: BatchPlan, micro_batch: int, steps_done: int) -> BatchInfo:
    t = cfg.training
    return BatchInfo(micro_batch=micro_batch, grad_accum=t.grad_accum, global_batch=plan.global_batch, steps=steps_done,
                     epochs=round(plan.epochs_done(steps_done), 6), warmup_steps=t.warmup_steps,
                     timed_steps=max(0, steps_done - t.warmup_steps), loader=t.loader,
                     loader_workers=t.loader_workers if t.loader == "dataloader" else 0)


def initial_record(cfg: ExperimentConfig, env: DistEnv, run_id: str, params: ParamCount, batch: BatchInfo) -> RunRecord:
    """The record a run starts with (status ``incomplete``); every rank builds the same one."""
    model_options = cfg.model.model_dump(mode="json", exclude={"family", "widths"})
    return RunRecord(
        run_id=run_id, name=cfg.name, status="incomplete", study=cfg.study, config_digest=cfg.digest(),
        started_at=now_iso(), seed=cfg.training.seed,
        strategy=StrategyInfo(name=cfg.strategy.name, label=cfg.strategy.label(), reference=cfg.strategy.reference,
                              options=cfg.strategy.model_dump(mode="json", exclude={"name"})),
        model=ModelInfo(family=cfg.model.family, widths=cfg.model.widths, grid=model_options.get("grid"),
                        order=model_options.get("k", model_options.get("degree")), options=model_options,
                        machine_choices=cfg.model.machine_choices(env.device.type),
                        params_trainable=params.trainable, params_total=params.total),
        task=TaskInfo(name=cfg.task.name, label=cfg.task.label, goal=cfg.task.goal.name, input_dim=cfg.task.input_dim,
                      n_train=cfg.task.n_train, n_test=cfg.task.n_test),
        topology=Topology(world_size=env.world_size, nodes=env.nodes, procs_per_node=env.local_world_size,
                          launcher=env.launcher, comm_backend=env.comm_backend, device_type=env.device.type,
                          device_name=device_name(env.device), threads_per_rank=torch.get_num_threads()),
        batch=batch, environment=environment_info(env),
        precision=PrecisionInfo(setting=cfg.training.precision, mechanism="not started: the backend sets it up"),
        compile=CompileInfo(setting=cfg.training.compile, mechanism="not started: the engine compiles",
                            mode=cfg.training.compile_mode),
    )


@dataclass(frozen=True)
class Window:
    """One timing window, combined across ranks."""

    first_step: int  # 0-based
    timed: bool
    steps: int
    samples: int  # global
    wall_s: float  # from the opening synchronize to the closing one, slowest rank
    times: WindowTimes


def combine_window(env: DistEnv, index: int, first_step: int, samples: list[StepSample], compute_s: float, wall_s: float,
                   warmup_steps: int) -> tuple[list[StepRecord], Window]:
    """Step records and the window summary from every rank's samples of one window (two
    collectives for the whole window). A step's exposed communication on a rank is its time
    beyond data and the compute baseline sampled after the window. Losses and samples are summed
    over the data-parallel replicas: the ranks within one replica (tensor parallel) hold the same."""
    losses = torch.stack([s.loss_share.double() for s in samples]).cpu().tolist()
    rows = [[loss, s.time_s, s.time_s - s.data_s - compute_s, s.samples, s.data_s, s.blocked_s or 0.0]
            for loss, s in zip(losses, samples)]
    has_check = all(s.blocked_s is not None for s in samples)
    rows.append([compute_s, wall_s, float(has_check), 0.0, 0.0, 0.0])
    table = torch.tensor(rows, dtype=torch.float64, device=env.device)
    summed = env.all_reduce(table.clone(), "sum").cpu().tolist()
    maxed = env.all_reduce(table, "max").cpu().tolist()
    world, per_replica = env.world_size, env.ranks_per_replica
    (compute_sum, _, checked, *_), window_max = summed.pop(), maxed.pop()
    compute = compute_sum / world
    steps = [StepRecord(step=first_step + n + 1, loss=s[0] / per_replica, time_s_max=m[1], time_s_mean=s[1] / world,
                        comm_s_max=m[2], comm_s_mean=s[2] / world, compute_s=compute, window=index,
                        samples=round(s[3] / per_replica), timed=first_step + n >= warmup_steps)
             for n, (s, m) in enumerate(zip(summed, maxed))]
    n = len(steps)
    times = WindowTimes(step_s=sum(s[1] for s in summed) / world / n, data_s=sum(s[4] for s in summed) / world / n,
                        compute_s=compute,
                        blocked_s=sum(s[5] for s in summed) / world / n if checked == world else None)
    return steps, Window(first_step=first_step, timed=first_step >= warmup_steps, steps=n,
                         samples=sum(r.samples for r in steps), wall_s=window_max[1], times=times)
def results(env: DistEnv, steps: list[StepRecord], windows: list[Window], state: ModelStateBytes, peaks: TrainingPeaks,
            replica_bytes: int, measurement: MeasurementConfig) -> dict:
    """The record's measured fields (a collective). ``steps`` are all the run's combined step
    records (from before a resume too); ``windows`` this attempt's timing windows, of which the
    timed ones give the rates, the compute baseline and exposed communication with their spread."""
    times = [r.time_s_max for r in steps if r.timed]
    timed = [w for w in windows if w.timed]
    wall, n_steps = sum(w.wall_s for w in timed), sum(w.steps for w in timed)
    step_mean = wall / n_steps
    samples_per_s = sum(w.samples for w in timed) / wall
    rates = [w.samples / w.wall_s for w in timed]
    check_valid = env.device.type == "cpu" and torch.get_num_threads() == 1
    comm = exposure([w.times for w in timed], step_mean, check_valid)
    exposed = trusted_seconds(comm)
    local = torch.tensor([max(0, peaks.rss - replica_bytes), max(0, peaks.device_bytes - replica_bytes), replica_bytes,
                          state.params, state.grads, state.optimizer, state.master_params], dtype=torch.float64)
    peak_rss, peak_device, replica, *state_max = (int(v) for v in env.all_reduce(local.to(env.device), "max").cpu().tolist())
    return dict(
        status="ok", error=None, finished_at=now_iso(),
        timings=Timings(total_s=sum(r.time_s_max for r in steps), step_mean_s=step_mean, step_p50_s=percentile(times, 50),
                        step_p95_s=percentile(times, 95), data_s=sum(w.times.data_s * w.steps for w in timed) / n_steps,
                        compute_s=statistics.median(w.times.compute_s for w in timed), comm_exposed_s=exposed),
        throughput=Throughput(samples_per_s=samples_per_s, samples_per_s_per_rank=samples_per_s / env.world_size,
                              samples_per_s_low=min(rates), samples_per_s_high=max(rates)),
        comm_overhead=max(-1.0, min(1.0, exposed / step_mean)), comm=comm,
        measurement=MeasurementInfo(
            comm_method="step time - data - compute of an unwrapped replica, sampled after each window on all ranks at once",
            comm_probe=measurement.comm_probe, baseline_steps=measurement.baseline_steps,
            check_method=blocked_clock_method() if check_valid else None, timing=measurement.timing,
            window_steps=measurement.window_steps, windows=len(timed)),
        memory=Memory(peak_device_bytes=peak_device if env.device.type == "cuda" else None, peak_rss_bytes=peak_rss,
                      replica_bytes=replica,
                      model_state=ModelStateBytes(**dict(zip(("params", "grads", "optimizer", "master_params"), state_max)))),
        final_loss=steps[-1].loss,
    )
