"""The strategy-agnostic training loop: data, model and engine in; a run record out.

Every rank runs this same code. Only rank 0 writes files; every rank takes part in the few
collectives that turn per-rank measurements into the run's numbers, and those happen outside
the timed windows.

Exposed communication is measured the same way for every strategy, without touching the
training: before training, each rank times its own per-step work (forward, backward and
optimizer step over the same micro-batches) on an unwrapped replica of the model, with no
communication at all. A training step's exposed communication is what it takes beyond that:
step time minus data time minus the replica's compute time. On CPUs with one thread per rank
an independent check is recorded beside it: step time minus the main thread's CPU time (a rank
blocked on a collective uses no CPU).
"""

from __future__ import annotations

import copy
import math
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from analysis.records import RunWriter
from analysis.schema import (
    BatchInfo, MeasurementInfo, Memory, ModelInfo, ModelStateBytes, RunError, RunRecord, StepRecord, StrategyInfo,
    TaskInfo, Throughput, Timings, Topology,
)
from kan_models import build_model, count_parameters
from kan_models.compile import compile_model
from strategies.config import ConfigError
from strategies.data import BatchPlan, rank_micro_batches
from strategies.distributed import DistEnv, device_name
from strategies.engine import Engine
from strategies.environment import environment_info
from strategies.experiment import ExperimentConfig, dump_yaml
from strategies.measure import peak_rss_bytes, percentile, reset_peak_rss
from strategies.optim import build_optimizer
from strategies.progress import Progress

Batches = list[tuple[torch.Tensor, torch.Tensor]]


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
    return f"{cfg.name}-{cfg.strategy.name}-p{world_size}-{stamp}-{secrets.token_hex(2)}"


def preflight(cfg: ExperimentConfig, device_type: str, world_size: int) -> BatchPlan:
    """Every problem that can be found before a process starts: the strategy's own checks, the
    batch split at this world size, the step count, the output directory."""
    if device_type == "cuda" and not torch.cuda.is_available() and cfg.runtime.device == "cuda":
        raise ConfigError("runtime.device: cuda was asked for but this machine has no CUDA device; set runtime.device=cpu or auto")
    cfg.strategy.preflight(cfg.training, device_type, world_size)
    t = cfg.training
    plan = BatchPlan(cfg.task.n_train, t.micro_batch_for(world_size) * t.grad_accum * world_size, t.seed, t.epochs, t.steps)
    if plan.total_steps <= t.warmup_steps:
        raise ConfigError(
            f"training.warmup_steps: {t.warmup_steps} warm-up steps leave none of the {plan.total_steps} steps to time; "
            "lower warmup_steps or train longer (training.epochs / training.steps)")
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; give a directory for the run records")
    return plan


class Trainer:
    """Runs one experiment on this rank and writes its record (rank 0)."""

    def __init__(self, cfg: ExperimentConfig, env: DistEnv, show_progress: bool | None = None) -> None:
        self.cfg, self.env = cfg, env
        t = cfg.training
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        self.plan = preflight(cfg, env.device.type, env.world_size)
        self.micro_batch = t.micro_batch_for(env.world_size)
        self.dtype = getattr(torch, t.dtype)
        self.data = cfg.task.generate(t.seed).to(env.device, self.dtype)
        self.model = build_model(cfg.model, t.seed).to(device=env.device, dtype=self.dtype)
        # Every rank starts from rank 0's weights: some initialisations (pykan's least-squares
        # fit) are not bitwise reproducible, and not every backend broadcasts them itself.
        env.broadcast_tensors(list(self.model.state_dict().values()))
        self.params = count_parameters(self.model)
        # A plain copy for refitting grids: the engine's model may be sharded or wrapped.
        self.grid_template = copy.deepcopy(self.model) if t.grid_update_every else None
        self.run_id = env.broadcast_string(new_run_id(cfg, env.world_size))
        self.run_dir = Path(cfg.output.dir) / self.run_id
        self.show_progress = show_progress
        self.steps_done = 0
        self.samples: list[StepSample] = []
        self.combined: list[StepRecord] = []
        self.compute_s = 0.0
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
            micro_batch=self.micro_batch, grad_accum=t.grad_accum, global_batch=self.plan.global_batch,
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
            self.compile_s = self._compile(self.model) if self.cfg.model.compile else None
            self.compute_s = self._measure_compute_baseline()
            self.engine: Engine = self.cfg.strategy.apply(self.model, self.cfg.training, self.env)
            self.record = self.record.model_copy(update={"strategy": self.record.strategy.model_copy(
                update={"distributed_type": self.engine.distributed_type(), "backend_config": self.engine.backend_config()})})
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

    def _local_batches(self, indices: torch.Tensor) -> Batches:
        """This rank's micro-batches of one global batch."""
        env, t = self.env, self.cfg.training
        return [(self.data.x_train[i], self.data.y_train[i])
                for i in rank_micro_batches(indices, t.grad_accum, env.world_size, env.rank)]

    def _compile(self, model: torch.nn.Module) -> float:
        """Compile the (unwrapped) model in place on a batch of the training shape; returns the
        compile time. Backends that replace parameters (FSDP, ZeRO-3) may recompile during the
        first steps, which the warm-up steps absorb."""
        sample = self._local_batches(self.plan.global_indices(0))[0][0]
        return compile_model(model, sample)[1]

    def _measure_compute_baseline(self) -> float:
        """Mean time of this rank's per-step work on an unwrapped replica (compiled when the
        model is), no communication. All ranks run it at the same time, so they contend for
        shared hardware as in training."""
        t = self.cfg.training
        replica = build_model(self.cfg.model, t.seed).to(device=self.env.device, dtype=self.dtype)
        replica.load_state_dict(self.model.state_dict())
        if self.cfg.model.compile:
            self._compile(replica)  # the model's compiled code is cached by now
        optimizer = build_optimizer(replica.parameters(), t)
        warmup, timed = min(t.warmup_steps, 3), self.cfg.measurement.baseline_steps
        times = []
        self.env.synchronize()
        for i in range(warmup + timed):
            indices = self.plan.global_indices(i % self.plan.total_steps)
            batches = self._local_batches(indices)
            start = time.perf_counter()
            for x, y in batches:
                ((replica(x) - y).pow(2).sum() / len(indices)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
            times.append(time.perf_counter() - start)
        return sum(times[warmup:]) / timed

    def _train(self) -> None:
        env = self.env
        reset_peak_rss()
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        loop_start = time.perf_counter()
        for step in range(self.plan.total_steps):
            self.samples.append(self._timed_step(step))
            self.steps_done = step + 1
            if self.progress.due(self.steps_done):
                self._flush_steps()
        self._flush_steps()
        self.loop_s = time.perf_counter() - loop_start

    def _grid_update_due(self, step: int) -> bool:
        t = self.cfg.training
        return bool(t.grid_update_every) and step % t.grid_update_every == 0 and (
            t.grid_update_until is None or step <= t.grid_update_until)

    def _timed_step(self, step: int) -> StepSample:
        env, engine = self.env, self.engine
        env.synchronize()
        start, cpu_start = time.perf_counter(), time.thread_time()
        indices = self.plan.global_indices(step)
        batches = self._local_batches(indices)
        data_s = time.perf_counter() - start
        if self._grid_update_due(step):
            self._update_grid(indices)
        engine.count_state_next_step = step == self.plan.total_steps - 1
        loss_share = self._forward_backward(batches, n_global=len(indices))
        engine.step()
        env.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        return StepSample(loss_share=loss_share, time_s=elapsed, data_s=data_s, cpu_s=cpu,
                          samples=sum(len(x) for x, _ in batches))

    def _forward_backward(self, batches: Batches, n_global: int) -> float:
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

    @torch.no_grad()
    def _update_grid(self, indices: torch.Tensor) -> None:
        """Refit the KAN grids to the step's whole global batch (every rank holds the data):
        gather the full model, refit a plain copy on rank 0, send its state to every rank and
        load it back, re-sharding where the engine shards. All ranks end identical."""
        state = self.engine.full_state_dict()
        if self.env.is_main:
            self.grid_template.load_state_dict(state)
            self.grid_template.update_grid(self.data.x_train[indices])
            for key, value in self.grid_template.state_dict().items():
                state[key].copy_(value)
        self.env.broadcast_tensors(list(state.values()))
        self.engine.load_full_state_dict(state)

    def _flush_steps(self) -> None:
        """Combine the pending per-rank step samples across ranks and append them to steps.jsonl."""
        first = len(self.combined)
        pending = self.samples[first:]
        if not pending:
            return
        comm = [max(0.0, s.time_s - s.data_s - self.compute_s) for s in pending]
        local = torch.tensor([[s.loss_share, s.time_s, c, s.samples] for s, c in zip(pending, comm)], dtype=torch.float64)
        peaks = torch.tensor([[s.time_s, c] for s, c in zip(pending, comm)], dtype=torch.float64)
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
        chunk = max(self.micro_batch, 1024)
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
        timed = [(r, s) for r, s in zip(self.combined, self.samples) if r.timed]
        times = [r.time_s_max for r, _ in timed]
        step_mean = sum(times) / len(times)
        # Per-rank means, averaged over ranks.
        local = torch.tensor([
            sum(s.data_s for _, s in timed) / len(timed),
            self.compute_s,
            sum(max(0.0, s.time_s - s.cpu_s) for _, s in timed) / len(timed),
        ], dtype=torch.float64)
        data_s, compute_s, check_s = (env.all_reduce(local.to(env.device), "sum").cpu() / env.world_size).tolist()
        state = self.engine.counted_state or self.engine.model_state_bytes()
        peaks = torch.tensor([float(peak_rss_bytes()),
                              float(torch.cuda.max_memory_allocated(env.device)) if env.device.type == "cuda" else 0.0,
                              state.params, state.grads, state.optimizer, state.master_params], dtype=torch.float64)
        peak_rss, peak_device, *state_max = (int(v) for v in env.all_reduce(peaks.to(env.device), "max").cpu().tolist())
        compute = min(compute_s, max(0.0, step_mean - data_s))
        comm = max(0.0, step_mean - data_s - compute)
        check_valid = env.device.type == "cpu" and torch.get_num_threads() == 1
        samples_per_s = sum(r.samples for r, _ in timed) / sum(times)
        return dict(
            status="ok", finished_at=now_iso(), batch=self._batch_info(),
            timings=Timings(total_s=self.loop_s, step_mean_s=step_mean, step_p50_s=percentile(times, 50),
                            step_p95_s=percentile(times, 95), data_s=data_s, compute_s=compute, comm_exposed_s=comm,
                            comm_exposed_check_s=check_s if check_valid else None, compile_s=self.compile_s),
            throughput=Throughput(samples_per_s=samples_per_s, samples_per_s_per_rank=samples_per_s / env.world_size),
            comm_overhead=min(1.0, comm / step_mean) if step_mean > 0 else 0.0,
            measurement=MeasurementInfo(comm_method="step time - data - compute-only replica",
                                        baseline_steps=self.cfg.measurement.baseline_steps,
                                        check_method="step time - main thread CPU time" if check_valid else None),
            memory=Memory(peak_device_bytes=peak_device if env.device.type == "cuda" else None, peak_rss_bytes=peak_rss,
                          model_state=ModelStateBytes(**dict(zip(("params", "grads", "optimizer", "master_params"), state_max)))),
            final_loss=self.combined[-1].loss, test_mse=test_mse,
        )

    def _fail(self, exc: BaseException) -> None:
        error = RunError(type=type(exc).__name__, message=str(exc) or type(exc).__name__,
                         rank=self.env.rank, step=self.steps_done)
        status = "incomplete" if isinstance(exc, KeyboardInterrupt) else "failed"
        self.record = self.record.model_copy(update=dict(
            status=status, error=error, finished_at=now_iso(), batch=self._batch_info()))
        self._write()


@dataclass(frozen=True)
class RunResult:
    record: RunRecord
    run_dir: Path
    is_main: bool  # rank 0, the rank that wrote the record


def train(cfg: ExperimentConfig, env: DistEnv | None = None, show_progress: bool | None = None) -> RunResult:
    """Train one experiment on this rank, joining the launch's process group where the strategy
    needs one."""
    env = env or DistEnv.from_environ(cfg.runtime.device)
    if cfg.strategy.needs_process_group or env.world_size > 1:
        env.init_process_group(cfg.runtime.timeout_s)
    trainer = Trainer(cfg, env, show_progress)
    result = RunResult(trainer.run(), trainer.run_dir, env.is_main)
    env.shutdown()
    return result
