"""The strategy-agnostic training loop: data, model and engine in; a run record out.

Every rank runs this same code. Only rank 0 writes the record while things go well (and holds
the run directory's lock, strategies/lifecycle/resume.py); every rank takes part in the few collectives
that turn per-rank measurements into the run's numbers (once per timing window, and at the
end), and those happen between the timed windows.

The loop never writes a loss formula (the task does) and never runs the model itself (the
engine does: ``forward_backward``, ``step``, ``evaluate``); it shards data by the data-parallel
position of :class:`DistEnv`, so a backend that splits a model over ranks fits unchanged.

Steps are timed in windows without synchronizing between them (strategies/measure/timing.py). After
each window every rank samples the compute-only baseline (strategies/measure/baseline.py) on the
window's last micro-batches, so exposed communication (strategies/measure/comm_exposure.py) compares
the training with a baseline taken on the same machine at the same time.

Around the loop: strategies/loop/model_setup.py builds the model and the baseline,
strategies/loop/step_log.py keeps and writes the step records, strategies/loop/run_end.py
evaluates the trained model or writes the failure.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.records.run_files import RunWriter
from analysis.records.schema import BatchInfo, CompileInfo, RunRecord, StepRecord
from kan_models import count_parameters
from kan_models.compile import graph_break_counts, graph_breaks
from strategies.experiment import ExperimentConfig, dump_yaml
from strategies.lifecycle.checkpoint import load_checkpoint, save_checkpoint
from strategies.lifecycle.disk import disk_full, free_space
from strategies.lifecycle.failures import inject_fault, raise_on_sigterm
from strategies.lifecycle.preflight import preflight
from strategies.lifecycle.resume import find_resumable, open_attempt
from strategies.loop.loader import MemoryBatches, batch_source
from strategies.loop.model_setup import build_baseline, build_rank_model, checkpoint_activations, compile_on_sample
from strategies.loop.progress import Progress
from strategies.loop.run_end import evaluate, write_failure
from strategies.loop.step_log import StepLog
from strategies.loop.trackers import Trackers, run_results
from strategies.measure.baseline import ComputeBaseline
from strategies.measure.combine import combine_memory, combine_window
from strategies.measure.comm_bytes import StepCommBytes
from strategies.measure.layerwise import LayerwiseBaseline
from strategies.measure.memory import TrainingPeaks
from strategies.measure.outside_load import Reading, combine_outside_load, read_now
from strategies.measure.probes import build_probe
from strategies.measure.record import batch_info, initial_record, new_run_id, results
from strategies.measure.step_profile import StepProfile
from strategies.measure.timing import StepTimer, window_bounds
from strategies.native_training import with_native_training
from strategies.runtime.distributed import DistEnv
from strategies.step.engine import Batch, Engine
from strategies.step.schedule import current_lr, lr_at, set_lr


class Trainer:
    """Runs one experiment on this rank and writes its record (rank 0)."""

    def __init__(
        self, cfg: ExperimentConfig, env: DistEnv, show_progress: bool | None = None, resume: Path | None = None
    ) -> None:
        cfg = with_native_training(cfg)
        t = cfg.training
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        self.plan = preflight(cfg, env.device.type, env.world_size)
        # The run's device mesh: from here on every part of the run reads its position from env.mesh.
        env = env.on_mesh(cfg.strategy.mesh_shape(env.world_size, env.local_world_size))
        assert env.mesh is not None  # on_mesh placed it
        self.cfg, self.env, self.mesh = cfg, env, env.mesh
        self.micro_batch = t.micro_batch_for(self.mesh.dp_size)
        self.dtype = getattr(torch, t.dtype)
        self.data = cfg.task.generate(t.seed).to(env.device, self.dtype)
        self.model = build_rank_model(cfg, env, self.dtype)
        self.params = count_parameters(self.model)
        # A plain copy for refitting grids: the engine's model may be sharded or wrapped.
        self.grid_template = copy.deepcopy(self.model) if t.grid_update_every else None
        self.checkpointed = checkpoint_activations(self.model, cfg)
        self.peaks = TrainingPeaks(env.device)
        self.probe = build_probe(cfg.measurement.comm_probe, env)
        counted = t.warmup_steps - 1 if t.compile == "none" and t.warmup_steps else None  # an untimed step, eager
        self.traffic = StepCommBytes(env, counted)
        self.profile = StepProfile(env, counted, self.model)
        run_dir = Path(
            env.broadcast_string(
                str(resume) if resume is not None else str(Path(cfg.output.dir) / new_run_id(cfg, env.world_size))
            )
        )
        # From here rank 0 holds the run directory's lock, until run() has written the last record.
        self.attempt = open_attempt(cfg, env, run_dir, resume=resume is not None)
        self.run_dir, self.checkpoint = run_dir, self.attempt.checkpoint
        self.start_step = len(self.attempt.steps)
        self.steps_done = self.start_step
        self.record = initial_record(cfg, env, run_dir.name, self.params, self._batch_info(self.start_step))
        if self.attempt.previous is not None and self.checkpoint is not None:
            self.record = self.record.model_copy(
                update={
                    "started_at": self.attempt.previous.started_at,
                    "resumed_at_steps": [*self.attempt.previous.resumed_at_steps, self.checkpoint.step],
                }
            )
        # The suite's own split, for shapes, the baseline's warm-up and grid refits; and the
        # experiment's data path (the same, or a DataLoader), which the steps take their batches from.
        x, y = self.data.x_train, self.data.y_train
        self.memory = MemoryBatches(x, y, self.plan, t, self.mesh.dp_size, self.mesh.dp_rank)
        self.baseline_kind = cfg.measurement.baseline_for(self.mesh.shape, t.compile)
        self.source = batch_source(
            x, y, self.plan, t, self.micro_batch, self.mesh.dp_size, self.mesh.dp_rank, env.device, self.start_step
        )
        self.last_batches: tuple[list[Batch], int] = self.memory.batches(self.start_step)
        self.breaks_before = graph_break_counts()  # the record counts this run's graph breaks only
        # What run() measures: the compile time, the baseline, the outside load around the timed steps.
        self.compile_s: float | None = None
        self.engine: Engine | None = None  # the strategy's, once run() has applied it
        self.baseline: ComputeBaseline | LayerwiseBaseline | None = None
        self.load_start: Reading | None = None
        self.load_end: Reading | None = None
        progress = Progress(
            self.plan.total_steps,
            enabled=env.is_main,
            interactive=show_progress,
            log_every=t.log_every,
            start=self.start_step,
        )
        # The run's steps, from before a resume too; rank 0 writes them and the record.
        self.log = StepLog(self.attempt.steps, RunWriter(run_dir) if env.is_main else None, progress)
        self.tracking = cfg.tracking.report_to if env.is_main else []

    @property
    def combined(self) -> list[StepRecord]:
        """The run's step records, from before a resume too."""
        return self.log.steps

    def _batch_info(self, steps_done: int) -> BatchInfo:
        return batch_info(self.cfg, self.plan, self.micro_batch, steps_done)

    def _write(self) -> None:
        if self.log.writer is not None:
            self.log.writer.write_summary(self.record)

    # ------------------------------------------------------------------------------ training

    def run(self) -> RunRecord:
        """Write an ``incomplete`` record, train, evaluate, write the final record. Whatever goes
        wrong after the record exists (the backend failing to start included) is written into it."""
        try:
            return self._run()
        finally:
            self.log.trackers.log_results(run_results(self.record), self.record.status)
            self.log.progress.close()
            self.source.close()
            self.attempt.release()  # the record is final: the directory is free for a resume

    def _run(self) -> RunRecord:
        if self.log.writer is not None:
            self.log.writer.write_config(dump_yaml(self.cfg.resolved()))
            self.log.trackers = Trackers.open(self.tracking, self.run_dir, self.cfg.name, self.cfg.resolved())
            if self.checkpoint is not None:
                self.log.writer.rewrite_steps(self.log.steps)
        self._write()
        try:
            if self.cfg.training.compile == "model":
                self.compile_s = compile_on_sample(self.model, self._sample(), self.cfg.training.compile_mode)
            self.baseline = build_baseline(
                self.baseline_kind, self.cfg, self.env, self.mesh, self.model, self.last_batches, self._sample()
            )
            engine: Engine = self.cfg.strategy.apply(self.model, self.cfg.training, self.env)
            self.engine = engine
            self.record = self.record.model_copy(
                update={
                    "strategy": self.record.strategy.model_copy(
                        update={
                            "label": engine.label or self.record.strategy.label,
                            "distributed_type": engine.distributed_type(),
                            "backend_config": engine.backend_config(),
                        }
                    ),
                    "precision": engine.precision_info(),
                    "compile": engine.compile_info(),
                }
            )
            if self.checkpoint is not None:
                load_checkpoint(engine, self.env, self.checkpoint)
            self._train(engine)
            self._finish(engine)
        except BaseException as exc:
            failure = disk_full(exc, self.run_dir, "in the run directory")  # named so, with the path and errno
            self.record = write_failure(
                failure,
                self.record,
                self.env,
                self.run_dir,
                self.attempt.number,
                self.log,
                self.steps_done,
                self._batch_info,
            )
            if failure is exc:
                raise
            raise failure from exc
        return self.record

    def _sample(self) -> torch.Tensor:
        """A micro-batch of the training shape, which the model is compiled on."""
        return self.memory.batches(0)[0][0][0]

    def _finish(self, engine: Engine) -> None:
        """Evaluate the trained model and write the final record."""
        test_metrics = evaluate(engine, self.env, self.mesh, self.data, self.cfg.task, self.micro_batch)
        state = engine.counted_state or engine.model_state_bytes()
        held = self.baseline.held_bytes if self.baseline else 0
        memory = combine_memory(self.env, self.peaks, held, state)
        counted, t = self.profile.memory(), self.cfg.training
        memory = memory.model_copy(
            update={
                "activation_checkpointing": t.activation_checkpointing,
                "activation_checkpointing_every": t.activation_checkpointing_every if self.checkpointed else None,
                "checkpointed_units": len(self.checkpointed),
                "activations_after_forward_bytes": counted[0] if counted else None,
                "step_peak": counted[1] if counted else None,
            }
        )
        measured = results(self.env, self.log.steps, self.log.windows, memory, self.cfg.measurement, self.baseline_kind)
        measured["timings"] = measured["timings"].model_copy(update={"compile_s": self.compile_s})
        outside = (
            combine_outside_load(self.env, self.load_start, self.load_end)
            if self.load_start and self.load_end
            else None
        )
        measured["measurement"] = measured["measurement"].model_copy(
            update={"outside_load": outside, **(self.probe.results() if self.probe is not None else {})}
        )
        self.record = self.record.model_copy(
            update={
                **measured,
                "test_metrics": test_metrics,
                "comm_bytes": self.traffic.result(),
                "flops": self.profile.flops(),
                "batch": self._batch_info(self.steps_done),
                "precision": engine.precision_info(),
                "compile": self._compile_info(engine),
            }
        )
        free_space(self.run_dir)  # the room kept for the last record (strategies/lifecycle/disk.py)
        self._write()

    def _compile_info(self, engine: Engine) -> CompileInfo:
        info = engine.compile_info()
        return (
            info
            if info.setting == "none"
            else info.model_copy(update={"graph_breaks": graph_breaks(self.breaks_before)})
        )

    def _train(self, engine: Engine) -> None:
        env, t, m = self.env, self.cfg.training, self.cfg.measurement
        timer = StepTimer(env, per_step=m.timing == "per_step")
        self.peaks.reset()
        bounds = window_bounds(
            self.start_step, self.plan.total_steps, t.warmup_steps, m.window_steps, t.checkpoint_every
        )
        for index, (first, end) in enumerate(bounds, start=self.log.first_window_index()):
            if self.load_start is None and first >= t.warmup_steps:
                self.load_start = read_now()
            timer.start_window()
            for step in range(first, end):
                self._step(engine, step, timer)
            sample = timer.end_window()
            # Between windows: the training's memory peaks, then the baseline on the window's last
            # micro-batches (its own step's memory never counts), then the one combining collective.
            self.peaks.read()
            compute_s = self.baseline.sample(*self.last_batches, self.cfg.task.loss_sum) if self.baseline else None
            self.peaks.reset()
            steps, window = combine_window(env, index, first, sample, compute_s, t.warmup_steps)
            self.log.add_window(steps, window, self.steps_done)
            checkpoint_due = t.checkpoint_every and end % t.checkpoint_every == 0
            if self.log.progress_due(first, end) or checkpoint_due:
                self.log.write(self.steps_done)
            if checkpoint_due:
                save_checkpoint(
                    engine,
                    env,
                    self.run_dir,
                    end,
                    {
                        "run_id": self.run_dir.name,
                        "config": self.cfg.resolved(),
                        "strategy": self.record.strategy.label,
                    },
                    keep=t.keep_checkpoints,
                )
        self.load_end = read_now()
        self.log.write(self.steps_done)

    def _grid_update_due(self, step: int) -> bool:
        t = self.cfg.training
        return (
            bool(t.grid_update_every)
            and step % t.grid_update_every == 0
            and (t.grid_update_until is None or step <= t.grid_update_until)
        )

    def _step(self, engine: Engine, step: int, timer: StepTimer) -> None:
        """One training step, stamped by ``timer``; nothing in it waits for the device or the
        other ranks beyond what the backend itself does."""
        inject_fault(self.cfg.fault, self.env.rank, step + 1)
        timer.start_step()
        batches, n_global = self.last_batches = self.source.batches(step)
        timer.data_ready()
        if self._grid_update_due(step):
            self._update_grid(engine, self.plan.global_indices(step))
        last = step == self.plan.total_steps - 1  # the step whose model state the record gives
        # Before the backward: under Accelerate's DeepSpeed plugin the last micro-batch's backward steps.
        set_lr(engine.optimizer, lr_at(self.cfg.training, step, self.plan.total_steps))
        started = time.perf_counter()
        with self.profile.around(step, engine, n_global), self.traffic.around(step):
            loss_share = engine.forward_backward(batches, self.cfg.task.loss_sum, n_global=n_global, count_state=last)
            if self.probe is not None:
                self.probe.after_backward(engine, batches, step)
            engine.step(count_state=last)
        self.log.lrs[step] = current_lr(engine.optimizer)  # what the step ran with, unless the backend changed it
        if engine.compilation is not None and step == self.start_step:
            # The whole step compiles in its first call: that call's time is the compile time
            # (a warm-up step, so it is in no timed window either way).
            self.compile_s = time.perf_counter() - started
        timer.end_step(loss_share, sum(len(x) for x, _ in batches))
        self.steps_done = step + 1

    @torch.no_grad()
    def _update_grid(self, engine: Engine, indices: torch.Tensor) -> None:
        """Refit the KAN grids to the step's whole global batch (every rank holds the data):
        gather the full model, refit a plain copy on rank 0, send its state to every rank and
        load it back, re-sharding where the engine shards. All ranks end identical."""
        state = engine.full_state_dict()
        if self.env.is_main:
            assert self.grid_template is not None  # kept whenever training.grid_update_every is set
            self.grid_template.load_state_dict(state)
            self.grid_template.update_grid(self.data.x_train[indices])  # type: ignore[operator]  # nn.Module.__getattr__ is typed Tensor | Module
            for key, value in self.grid_template.state_dict().items():
                state[key].copy_(value)
        self.env.broadcast_tensors(list(state.values()))
        engine.load_full_state_dict(state)


@dataclass(frozen=True)
class RunResult:
    record: RunRecord
    run_dir: Path
    is_main: bool  # rank 0, the rank that wrote the record


def train(
    cfg: ExperimentConfig, env: DistEnv | None = None, show_progress: bool | None = None, resume: Path | bool = False
) -> RunResult:
    """Train one experiment on this rank, joining the launch's process group where the strategy
    needs one. ``resume``: a run directory to continue, or True for the newest resumable run of
    this experiment."""
    cfg = with_native_training(cfg)  # before the run is looked up: its digest holds what the file decided
    env = env or DistEnv.from_environ(cfg.runtime.device)
    raise_on_sigterm()
    if cfg.strategy.needs_process_group or env.world_size > 1:
        env.init_process_group(cfg.runtime.timeout_s)
    if resume is True:
        resume = find_resumable(cfg, env.world_size)
    trainer = Trainer(cfg, env, show_progress, resume=resume or None)
    result = RunResult(trainer.run(), trainer.run_dir, env.is_main)
    env.shutdown()
    return result
