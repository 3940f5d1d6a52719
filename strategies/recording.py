"""Turning one run's configuration and measurements into its run record (the metrics schema in
analysis/schema.py)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from analysis.schema import (
    BatchInfo, MeasurementInfo, Memory, ModelInfo, ModelStateBytes, RunRecord, StepRecord, StrategyInfo, TaskInfo,
    Throughput, Timings, Topology,
)
from kan_models import ParamCount
from strategies.data import BatchPlan
from strategies.distributed import DistEnv, device_name
from strategies.environment import environment_info
from strategies.experiment import ExperimentConfig
from strategies.measure import peak_rss_bytes, percentile


@dataclass
class StepSample:
    """One rank's measurements of one step, before they are combined across ranks."""

    loss_share: float
    time_s: float
    data_s: float
    cpu_s: float
    samples: int


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_run_id(cfg: ExperimentConfig, world_size: int) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.name}-{cfg.strategy.label()}-p{world_size}-{stamp}-{secrets.token_hex(2)}"


def batch_info(cfg: ExperimentConfig, plan: BatchPlan, micro_batch: int, steps_done: int) -> BatchInfo:
    t = cfg.training
    return BatchInfo(micro_batch=micro_batch, grad_accum=t.grad_accum, global_batch=plan.global_batch, steps=steps_done,
                     epochs=round(plan.epochs_done(steps_done), 6), warmup_steps=t.warmup_steps,
                     timed_steps=max(0, steps_done - t.warmup_steps))


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
                        params_trainable=params.trainable, params_total=params.total),
        task=TaskInfo(name=cfg.task.name, input_dim=cfg.task.input_dim, n_train=cfg.task.n_train, n_test=cfg.task.n_test),
        topology=Topology(world_size=env.world_size, nodes=env.nodes, procs_per_node=env.local_world_size,
                          launcher=env.launcher, comm_backend=env.comm_backend, device_type=env.device.type,
                          device_name=device_name(env.device)),
        batch=batch, environment=environment_info(env),
    )


def combine_steps(env: DistEnv, first_step: int, samples: list[StepSample], compute_s: float,
                  warmup_steps: int) -> list[StepRecord]:
    """Step records from every rank's samples of steps ``first_step + 1 ...`` (a collective).
    A step's exposed communication on a rank is its time beyond data and compute. Losses and
    samples are summed over the data-parallel replicas: the ranks within one replica (tensor
    parallel) hold the same ones."""
    comm = [max(0.0, s.time_s - s.data_s - compute_s) for s in samples]
    summed = env.all_reduce(torch.tensor([[s.loss_share, s.time_s, c, s.samples] for s, c in zip(samples, comm)],
                                         dtype=torch.float64, device=env.device), "sum").cpu().tolist()
    maxed = env.all_reduce(torch.tensor([[s.time_s, c] for s, c in zip(samples, comm)], dtype=torch.float64,
                                        device=env.device), "max").cpu().tolist()
    world, per_replica = env.world_size, env.ranks_per_replica
    return [StepRecord(step=first_step + n + 1, loss=s[0] / per_replica, time_s_max=m[0], time_s_mean=s[1] / world,
                       comm_s_max=m[1], comm_s_mean=s[2] / world, samples=round(s[3] / per_replica),
                       timed=first_step + n >= warmup_steps)
            for n, (s, m) in enumerate(zip(summed, maxed))]


def results(env: DistEnv, steps: list[StepRecord], own: list[StepSample], compute_s: float, state: ModelStateBytes,
            baseline_steps: int, comm_probe: str = "none") -> dict:
    """The record's measured fields. ``steps`` are all the run's combined step records (from
    before a resume too); ``own`` are this process's samples of its timed steps (a collective)."""
    timed = [r for r in steps if r.timed]
    times = [r.time_s_max for r in timed]
    step_mean = sum(times) / len(times)
    local = torch.tensor([sum(s.data_s for s in own) / max(1, len(own)), compute_s,
                          sum(max(0.0, s.time_s - s.cpu_s) for s in own) / max(1, len(own))], dtype=torch.float64)
    data_s, compute_s, check_s = (env.all_reduce(local.to(env.device), "sum").cpu() / env.world_size).tolist()
    peaks = torch.tensor([float(peak_rss_bytes()),
                          float(torch.cuda.max_memory_allocated(env.device)) if env.device.type == "cuda" else 0.0,
                          state.params, state.grads, state.optimizer, state.master_params], dtype=torch.float64)
    peak_rss, peak_device, *state_max = (int(v) for v in env.all_reduce(peaks.to(env.device), "max").cpu().tolist())
    compute = min(compute_s, max(0.0, step_mean - data_s))
    comm = max(0.0, step_mean - data_s - compute)
    check_valid = env.device.type == "cpu" and torch.get_num_threads() == 1
    samples_per_s = sum(r.samples for r in timed) / sum(times)
    return dict(
        status="ok", error=None, finished_at=now_iso(),
        timings=Timings(total_s=sum(r.time_s_max for r in steps), step_mean_s=step_mean, step_p50_s=percentile(times, 50),
                        step_p95_s=percentile(times, 95), data_s=data_s, compute_s=compute, comm_exposed_s=comm,
                        comm_exposed_check_s=check_s if check_valid else None),
        throughput=Throughput(samples_per_s=samples_per_s, samples_per_s_per_rank=samples_per_s / env.world_size),
        comm_overhead=min(1.0, comm / step_mean) if step_mean > 0 else 0.0,
        measurement=MeasurementInfo(comm_method="step time - data - compute-only replica", comm_probe=comm_probe,
                                    baseline_steps=baseline_steps,
                                    check_method="step time - main thread CPU time" if check_valid else None),
        memory=Memory(peak_device_bytes=peak_device if env.device.type == "cuda" else None, peak_rss_bytes=peak_rss,
                      model_state=ModelStateBytes(**dict(zip(("params", "grads", "optimizer", "master_params"), state_max)))),
        final_loss=steps[-1].loss,
    )
