"""The strategy-agnostic training loop: data, model and engine in; a run record out.

Every rank runs this same code. Only rank 0 writes files; every rank takes part in the few
collectives that turn per-rank measurements into the run's numbers, and those happen outside
the timed windows.
"""

from __future__ import annotations

import math
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from analysis.records import RunWriter
from analysis.schema import (
    BatchInfo, Memory, ModelInfo, ModelStateBytes, RunError, RunRecord, StepRecord, StrategyInfo, TaskInfo,
    Throughput, Timings, Topology,
)
from kan_models import build_model, count_parameters
from strategies.config import ConfigError
from strategies.data import BatchPlan, rank_micro_batches
from strategies.distributed import DistEnv, device_name
from strategies.engine import Engine
from strategies.environment import environment_info
from strategies.experiment import ExperimentConfig, dump_yaml
from strategies.measure import peak_rss_bytes, percentile, reset_peak_rss
from strategies.progress import Progress


@dataclass
class StepSample:
    """One rank's measurements of one step, before they are combined across ranks."""

    loss_share: float
    time_s: float
    comm_s: float
    data_s: float
    samples: int


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_run_id(cfg: ExperimentConfig, world_size: int) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.name}-{cfg.strategy.name}-p{world_size}-{stamp}-{secrets.token_hex(2)}"


def check_runnable(cfg: ExperimentConfig, plan: BatchPlan) -> None:
    """Problems that need the resolved sizes, reported before anything trains."""
    if plan.total_steps <= cfg.training.warmup_steps:
        raise ConfigError(
            f"training.warmup_steps: {cfg.training.warmup_steps} warm-up steps leave none of the "
            f"{plan.total_steps} steps to time; lower warmup_steps or train longer (training.epochs / training.steps)")
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; give a directory for the run records")


class Trainer:
    """Runs one experiment on this rank and writes its record (rank 0)."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv, show_progress: bool | None = None) -> None:
        self.cfg, self.env = cfg, env
        t = cfg.training
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        self.dtype = getattr(torch, t.dtype)
        self.plan = BatchPlan(cfg.task.n_train, t.micro_batch * t.grad_accum * env.world_size, t.seed, t.epochs, t.steps)
        check_runnable(cfg, self.plan)
        self.data = cfg.task.generate(t.seed).to(env.device, self.dtype)
        self.model = build_model(cfg.model, t.seed).to(device=env.device, dtype=self.dtype)
        self.params = count_parameters(self.model)
        self.run_id = env.broadcast_string(new_run_id(cfg, env.world_size))
        self.run_dir = Path(cfg.output.dir) / self.run_id
        self.show_progress = show_progress
        self.steps_done = 0
        self.samples: list[StepSample] = []
        self.combined: list[StepRecord] = []
        self.record = self._initial_record()
        self.writer: RunWriter | None = None

    # ----------------------------------------------------------------------------- records

    def _initial_record(self) -> RunRecord:
        cfg, env, t = self.cfg, self.env, self.cfg.training
        model_options = cfg.model.model_dump(mode="json", exclude={"family", "widths"})
        return RunRecord(
            run_id=self.run_id, name=cfg.name, status="incomplete", study=cfg.study,
            config_digest=cfg.digest(), started_at=now_iso(), seed=t.seed,
            strategy=StrategyInfo(name=cfg.strategy.name, options=cfg.strategy.model_dump(mode="json", exclude={"name"})),
            model=ModelInfo(
                family=cfg.model.family, widths=cfg.model.widths,
                grid=model_options.get("grid"), order=model_options.get("k", model_options.get("degree")),
                options=model_options, params_trainable=self.params.trainable, params_total=self.params.total),
            task=TaskInfo(name=cfg.task.name, input_dim=cfg.task.input_dim, n_train=cfg.task.n_train, n_test=cfg.task.n_test),
            topology=Topology(
                world_size=env.world_size, nodes=env.nodes, procs_per_node=env.local_world_size,
                launcher=env.launcher, comm_backend=env.comm_backend,
                device_type=env.device.type, device_name=device_name(env.device)),
            batch=self._batch_info(),
            environment=environment_info(env),
        )

    def _batch_info(self) -> BatchInfo:
        t = self.cfg.training
        return BatchInfo(
            micro_batch=t.micro_batch, grad_accum=t.grad_accum, global_batch=self.plan.global_batch,
            steps=self.steps_done, epochs=round(self.plan.epochs_done(self.steps_done), 6),
            warmup_steps=t.warmup_steps, timed_steps=max(0, self.steps_done - t.warmup_steps))

    def _write(self) -> None:
        if self.writer is not None:
            self.writer.write_summary(self.record)

    # ------------------------------------------------------------------------------ training

    def run(self) -> RunRecord:
        """Write an ``incomplete`` record, train, evaluate, write the final record. Whatever goes
        wrong after the record exists (the backend failing to start included) is written into it."""
        if self.env.is_main:
            self.writer = RunWriter(self.run_dir)
            self.writer.write_config(dump_yaml(self.cfg.resolved()))
        self._write()
        self.progress = Progress(self.plan.total_steps, enabled=self.env.is_main, interactive=self.show_progress,
                                 log_every=self.cfg.training.log_every)
        try:
            self.engine: Engine = self.cfg.strategy.apply(self.model, self.cfg.training, self.env)
            self._train()
            test_mse = self._evaluate()
            self.record = self.record.model_copy(update=self._results(test_mse))
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.progress.close()
        self._write()
        return self.record

    def _train(self) -> None:
        env, t = self.env, self.cfg.training
        reset_peak_rss()
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        self.model_state = ModelStateBytes(params=0, grads=0, optimizer=0)
        self.loop_start = time.perf_counter()
        for step in range(self.plan.total_steps):
            self.samples.append(self._timed_step(step))
            self.steps_done = step + 1
            if self.progress.due(self.steps_done):
                self._flush_steps()
        self._flush_steps()
        self.loop_s = time.perf_counter() - self.loop_start

    def _timed_step(self, step: int) -> StepSample:
        env, t, engine = self.env, self.cfg.training, self.engine
        env.synchronize()
        start = time.perf_counter()
        indices = self.plan.global_indices(step)
        batches = [(self.data.x_train[i], self.data.y_train[i])
                   for i in rank_micro_batches(indices, t.grad_accum, env.world_size, env.rank)]
        data_s = time.perf_counter() - start
        if t.grid_update_every and step % t.grid_update_every == 0 and (t.grid_update_until is None or step <= t.grid_update_until):
            engine.update_grid(batches[0][0])
        loss_share = self._forward_backward(batches, n_global=len(indices))
        if step == self.plan.total_steps - 1:
            self.model_state = engine.model_state_bytes()  # gradients exist only until step()
        engine.step()
        env.synchronize()
        elapsed = time.perf_counter() - start
        local_samples = sum(len(x) for x, _ in batches)
        return StepSample(loss_share=loss_share, time_s=elapsed, comm_s=0.0, data_s=data_s, samples=local_samples)

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n_global: int) -> float:
        """Accumulate the gradient of the global-batch mean squared error; return this rank's
        share of that loss."""
        engine = self.engine
        total = torch.zeros((), device=self.env.device, dtype=self.dtype)
        for i, (x, y) in enumerate(batches):
            with engine.gradient_sync(i == len(batches) - 1):
                loss = (engine.model(x) - y).pow(2).sum() / n_global
                engine.backward(loss)
            total += loss.detach()
        return float(total)

    def _flush_steps(self) -> None:
        """Combine the pending per-rank step samples across ranks and append them to steps.jsonl."""
        first = len(self.combined)
        pending = self.samples[first:]
        if not pending:
            return
        local = torch.tensor([[s.loss_share, s.time_s, s.comm_s, s.samples] for s in pending], dtype=torch.float64)
        peaks = torch.tensor([[s.time_s, s.comm_s] for s in pending], dtype=torch.float64)
        summed = self.env.all_reduce(local.to(self.env.device), "sum").cpu()
        maxed = self.env.all_reduce(peaks.to(self.env.device), "max").cpu()
        world, warmup = self.env.world_size, self.cfg.training.warmup_steps
        records = [
            StepRecord(step=first + n + 1, loss=float(s[0]), time_s_max=float(m[0]), time_s_mean=float(s[1]) / world,
                       comm_s_max=float(m[1]), comm_s_mean=float(s[2]) / world, samples=int(s[3]),
                       timed=first + n >= warmup)
            for n, (s, m) in enumerate(zip(summed.tolist(), maxed.tolist()))
        ]
        self.combined.extend(records)
        if self.writer is not None:
            self.writer.append_steps(records)
        last = records[-1]
        self.progress.update(self.steps_done, loss=last.loss, samples_per_s=last.samples / max(last.time_s_max, 1e-12))

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Test MSE of the trained model, each rank evaluating a shard. Every rank runs the same
        number of forward passes, which sharded strategies need."""
        env, model = self.env, self.engine.model
        n_test = self.data.x_test.shape[0]
        shard = torch.arange(n_test).tensor_split(env.world_size)[env.rank]
        chunk = max(self.cfg.training.micro_batch, 1024)
        n_chunks = max(1, math.ceil(math.ceil(n_test / env.world_size) / chunk))
        model.eval()
        sse = torch.zeros((), dtype=torch.float64, device=env.device)
        for idx in shard.tensor_split(n_chunks):
            sse += (model(self.data.x_test[idx]) - self.data.y_test[idx]).pow(2).sum().double()
        model.train()
        return float(env.all_reduce(sse, "sum")) / n_test

    # ------------------------------------------------------------------------------- results

    def _results(self, test_mse: float) -> dict:
        env = self.env
        timed = [r for r in self.combined if r.timed]
        local = [s for s, r in zip(self.samples, self.combined) if r.timed]
        times = [r.time_s_max for r in timed]
        step_mean = sum(times) / len(times)
        comm = sum(r.comm_s_mean for r in timed) / len(timed)
        data = sum(s.data_s for s in local) / len(local)
        samples_per_s = sum(r.samples for r in timed) / sum(times)
        peaks = torch.tensor([float(peak_rss_bytes()),
                              float(torch.cuda.max_memory_allocated(env.device)) if env.device.type == "cuda" else 0.0],
                             dtype=torch.float64)
        peak_rss, peak_device = env.all_reduce(peaks.to(env.device), "max").cpu().tolist()
        return dict(
            status="ok", finished_at=now_iso(), batch=self._batch_info(),
            timings=Timings(total_s=self.loop_s, step_mean_s=step_mean, step_p50_s=percentile(times, 50),
                            step_p95_s=percentile(times, 95), compute_s=max(0.0, step_mean - comm - data),
                            comm_exposed_s=comm, data_s=data),
            throughput=Throughput(samples_per_s=samples_per_s, samples_per_s_per_rank=samples_per_s / env.world_size),
            comm_overhead=min(1.0, comm / step_mean) if step_mean > 0 else 0.0,
            memory=Memory(peak_device_bytes=int(peak_device) if env.device.type == "cuda" else None,
                          peak_rss_bytes=int(peak_rss), model_state=self.model_state),
            final_loss=self.combined[-1].loss, test_mse=test_mse,
        )

    def _fail(self, exc: BaseException) -> None:
        error = RunError(type=type(exc).__name__, message=str(exc) or type(exc).__name__,
                         rank=self.env.rank, step=self.steps_done)
        status = "incomplete" if isinstance(exc, KeyboardInterrupt) else "failed"
        self.record = self.record.model_copy(update=dict(
            status=status, error=error, finished_at=now_iso(), batch=self._batch_info()))
        self._write()


def train(cfg: ExperimentConfig, env: DistEnv | None = None, show_progress: bool | None = None) -> tuple[RunRecord, Path]:
    """Train one experiment on this rank; returns the run record and its directory."""
    env = env or DistEnv.from_environ(cfg.runtime.device)
    trainer = Trainer(cfg, env, show_progress)
    return trainer.run(), trainer.run_dir
