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
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.records import RunWriter
from analysis.schema import CompileInfo, RunError, RunRecord, StepRecord
from kan_models import build_model, count_parameters
from kan_models.compile import compile_model, graph_break_counts, graph_breaks
from kanscale.errors import ConfigError
from strategies.distributed import DistEnv
from strategies.engine import Batch, Engine
from strategies.experiment import ExperimentConfig, dump_yaml
from strategies.lifecycle.checkpoint import discard_partial_saves, load_checkpoint, save_checkpoint
from strategies.lifecycle.disk import disk_full, free_space
from strategies.lifecycle.export import read_export
from strategies.lifecycle.failures import (
    STOPPED,
    FailureReport,
    check_finite,
    inject_fault,
    raise_on_sigterm,
    record_failure,
    reporting_failure,
    reports_dir,
)
from strategies.lifecycle.preflight import preflight
from strategies.lifecycle.resume import find_resumable, open_attempt
from strategies.loop.loader import MemoryBatches, batch_source
from strategies.loop.progress import Progress
from strategies.measure.baseline import ComputeBaseline
from strategies.measure.combine import Window, combine_memory, combine_window
from strategies.measure.comm_bytes import StepCommBytes
from strategies.measure.layerwise import LayerwiseBaseline
from strategies.measure.memory import TrainingPeaks
from strategies.measure.outside_load import combine_outside_load, read_now
from strategies.measure.probes import build_probe
from strategies.measure.record import batch_info, initial_record, new_run_id, now_iso, results
from strategies.measure.timing import StepTimer, window_bounds
from strategies.native_training import with_native_training
from strategies.schedule import current_lr, lr_at, set_lr


def load_exported(path: str, cfg: ExperimentConfig) -> dict[str, torch.Tensor]:
    """The weights of a ``kanscale export`` file, after checking they are for this model."""
    exported = read_export(path, "training.init_from")
    theirs, ours = exported["model"], cfg.model.model_dump(mode="json")
    differ = [k for k in ("family", "widths", *cfg.model.identity) if theirs.get(k) != ours.get(k)]
    if differ:
        raise ConfigError(
            f"training.init_from: {path} holds a {theirs['family']} {theirs['widths']} model, which differs "
            f"from this experiment's in {', '.join(differ)}; use an export of the same model"
        )
    return exported["model_state"]


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
        self.cfg, self.env, mesh = cfg, env, env.mesh
        self.micro_batch = t.micro_batch_for(mesh.dp_size)
        self.dtype = getattr(torch, t.dtype)
        self.data = cfg.task.generate(t.seed).to(env.device, self.dtype)
        self.model = build_model(cfg.model, t.seed)
        if t.init_from:
            self.model.load_state_dict(load_exported(t.init_from, cfg))
        self.model.to(device=env.device, dtype=self.dtype)
        # Every rank starts from rank 0's weights: some initialisations (pykan's least-squares
        # fit) are not bitwise reproducible, and not every backend broadcasts them itself. A
        # factory that built another model on some rank would fail inside the broadcast, naming nothing.
        layout = "; ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in self.model.state_dict().items())
        if differ := env.ranks_differing(hashlib.sha256(layout.encode()).hexdigest()):
            raise ConfigError(
                f"model: rank(s) {differ} built a model other than rank 0's (names, shapes or dtypes of its "
                f"tensors differ); the model ({cfg.model.family}, model.factory where custom) must be built "
                "the same on every rank: do not make it depend on the rank"
            )
        env.broadcast_tensors(list(self.model.state_dict().values()))
        self.params = count_parameters(self.model)
        # A plain copy for refitting grids: the engine's model may be sharded or wrapped.
        self.grid_template = copy.deepcopy(self.model) if t.grid_update_every else None
        self.show_progress = show_progress
        self.windows: list[Window] = []  # this attempt's timing windows
        self.peaks = TrainingPeaks(env.device)
        self.probe = build_probe(cfg.measurement.comm_probe, env)
        counted = t.warmup_steps - 1 if t.compile == "none" and t.warmup_steps else None  # an untimed step, eager
        self.traffic = StepCommBytes(env, counted)
        run_dir = Path(
            env.broadcast_string(
                str(resume) if resume is not None else str(Path(cfg.output.dir) / new_run_id(cfg, env.world_size))
            )
        )
        # From here rank 0 holds the run directory's lock, until run() has written the last record.
        self.attempt = open_attempt(cfg, env, run_dir, resume=resume is not None)
        self.run_dir, self.checkpoint = run_dir, self.attempt.checkpoint
        self.combined: list[StepRecord] = self.attempt.steps  # the run's steps, from before a resume too
        self.start_step = len(self.combined)
        self.steps_done = self.start_step
        self.written = self.start_step  # of self.combined, the steps in steps.jsonl
        self.record = initial_record(cfg, env, run_dir.name, self.params, self._batch_info(self.start_step))
        # The suite's own split, for shapes, the baseline's warm-up and grid refits; and the
        # experiment's data path (the same, or a DataLoader), which the steps take their batches from.
        x, y = self.data.x_train, self.data.y_train
        self.memory = MemoryBatches(x, y, self.plan, t, mesh.dp_size, mesh.dp_rank)
        self.baseline_kind = cfg.measurement.baseline_for(mesh.shape, t.compile)
        self.source = batch_source(
            x, y, self.plan, t, self.micro_batch, mesh.dp_size, mesh.dp_rank, env.device, self.start_step
        )
        self.last_batches: tuple[list[Batch], int] = self.memory.batches(self.start_step)
        if self.attempt.previous is not None:
            self.record = self.record.model_copy(
                update={
                    "started_at": self.attempt.previous.started_at,
                    "resumed_at_steps": [*self.attempt.previous.resumed_at_steps, self.checkpoint.step],
                }
            )
        self.writer: RunWriter | None = None
        self.step_lrs: dict[int, float] = {}  # this window's learning rates, read from the optimizer, by step
        self.breaks_before = graph_break_counts()  # the record counts this run's graph breaks only

    def _batch_info(self, steps_done: int):
        return batch_info(self.cfg, self.plan, self.micro_batch, steps_done)

    def _write(self) -> None:
        if self.writer is not None:
            self.writer.write_summary(self.record)

    # ------------------------------------------------------------------------------ training

    def run(self) -> RunRecord:
        """Write an ``incomplete`` record, train, evaluate, write the final record. Whatever goes
        wrong after the record exists (the backend failing to start included) is written into it."""
        try:
            return self._run()
        finally:
            self.attempt.release()  # the record is final: the directory is free for a resume

    def _run(self) -> RunRecord:
        if self.env.is_main:
            self.writer = RunWriter(self.run_dir)
            self.writer.write_config(dump_yaml(self.cfg.resolved()))
            if self.checkpoint is not None:
                self.writer.rewrite_steps(self.combined)
        self._write()
        self.progress = Progress(
            self.plan.total_steps,
            enabled=self.env.is_main,
            interactive=self.show_progress,
            log_every=self.cfg.training.log_every,
            start=self.start_step,
        )
        try:
            self.compile_s = self._compile(self.model) if self.cfg.training.compile == "model" else None
            self.baseline = self._build_baseline()
            self.engine: Engine = self.cfg.strategy.apply(self.model, self.cfg.training, self.env)
            self.record = self.record.model_copy(
                update={
                    "strategy": self.record.strategy.model_copy(
                        update={
                            "label": self.engine.label or self.record.strategy.label,
                            "distributed_type": self.engine.distributed_type(),
                            "backend_config": self.engine.backend_config(),
                        }
                    ),
                    "precision": self.engine.precision_info(),
                    "compile": self.engine.compile_info(),
                }
            )
            if self.checkpoint is not None:
                load_checkpoint(self.engine, self.env, self.checkpoint)
            self._train()
            test_metrics = self._evaluate()
            state = self.engine.counted_state or self.engine.model_state_bytes()
            memory = combine_memory(self.env, self.peaks, self.baseline.held_bytes if self.baseline else 0, state)
            measured = results(self.env, self.combined, self.windows, memory, self.cfg.measurement, self.baseline_kind)
            measured["timings"] = measured["timings"].model_copy(update={"compile_s": self.compile_s})
            outside = combine_outside_load(self.env, self.load_start, self.load_end) if self.load_start else None
            measured["measurement"] = measured["measurement"].model_copy(
                update={"outside_load": outside, **(self.probe.results() if self.probe is not None else {})}
            )
            self.record = self.record.model_copy(
                update={
                    **measured,
                    "test_metrics": test_metrics,
                    "comm_bytes": self.traffic.result(),
                    "batch": self._batch_info(self.steps_done),
                    "precision": self.engine.precision_info(),
                    "compile": self._compile_info(),
                }
            )
            free_space(self.run_dir)  # the room kept for the last record (strategies/lifecycle/disk.py)
            self._write()
        except BaseException as exc:
            failure = disk_full(exc, self.run_dir, "in the run directory")  # named so, with the path and errno
            self._fail(failure)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self.progress.close()
            self.source.close()
        return self.record

    def _compile_info(self) -> CompileInfo:
        info = self.engine.compile_info()
        return (
            info
            if info.setting == "none"
            else info.model_copy(update={"graph_breaks": graph_breaks(self.breaks_before)})
        )

    def _compile(self, model: torch.nn.Module) -> float:
        """Compile the (unwrapped) model in place on a batch of the training shape; returns the
        compile time. Backends that replace parameters (FSDP, ZeRO-3) may recompile during the
        first steps, which the warm-up steps absorb."""
        sample = self.memory.batches(0)[0][0][0]
        mode = self.cfg.training.compile_mode
        return compile_model(model, sample, **({} if mode == "default" else {"mode": mode}))[1]

    def _build_baseline(self) -> ComputeBaseline | LayerwiseBaseline | None:
        """The compute-only baseline measurement.baseline asks for (None: off), warmed up on this
        attempt's first batches; every rank builds its own at the same time, before the strategy
        wraps the model."""
        t, m = self.cfg.training, self.cfg.measurement
        if self.baseline_kind == "off":
            return None
        if self.baseline_kind == "layerwise":
            baseline = LayerwiseBaseline(
                self.model,
                self.cfg.strategy.wrap_units(self.model),
                self.env.device,
                t,
                self.env.mesh.shape.dp_shard,
                m.baseline_steps,
            )
        else:

            def replica() -> torch.nn.Module:
                model = build_model(self.cfg.model, t.seed).to(device=self.env.device, dtype=self.dtype)
                model.load_state_dict(self.model.state_dict())
                if t.compile == "model":
                    self._compile(model)  # the model's compiled code is cached by now
                return self.cfg.strategy.compute_replica(model, self.env)

            baseline = ComputeBaseline(replica, self.env.device, t, m.baseline_steps)
        baseline.warm_up(*self.last_batches, self.cfg.task.loss_sum, steps=min(t.warmup_steps, 3))
        return baseline

    def _train(self) -> None:
        env, t, m = self.env, self.cfg.training, self.cfg.measurement
        timer = StepTimer(env, per_step=m.timing == "per_step")
        numbered = [s.window for s in self.combined if s.window is not None]
        first_index = max(numbered) + 1 if numbered else 0
        self.peaks.reset()
        self.load_start = self.load_end = None
        bounds = window_bounds(
            self.start_step, self.plan.total_steps, t.warmup_steps, m.window_steps, t.checkpoint_every
        )
        for index, (first, end) in enumerate(bounds, start=first_index):
            if self.load_start is None and first >= t.warmup_steps:
                self.load_start = read_now()
            timer.start_window()
            for step in range(first, end):
                self._step(step, timer)
            sample = timer.end_window()
            # Between windows: the training's memory peaks, then the baseline on the window's last
            # micro-batches (its own step's memory never counts), then the one combining collective.
            self.peaks.read()
            compute_s = self.baseline.sample(*self.last_batches, self.cfg.task.loss_sum) if self.baseline else None
            self.peaks.reset()
            steps, window = combine_window(env, index, first, sample, compute_s, t.warmup_steps)
            steps = [s.model_copy(update={"lr": self.step_lrs.pop(s.step - 1)}) for s in steps]
            finite = [s for s in steps if math.isfinite(s.loss)]
            self.combined += finite
            if len(finite) < len(steps):
                self._write_steps()
                check_finite(steps[len(finite)].loss, steps[len(finite)].step)
            self.windows.append(window)
            checkpoint_due = t.checkpoint_every and end % t.checkpoint_every == 0
            if any(self.progress.due(n) for n in range(first + 1, end + 1)) or checkpoint_due:
                self._write_steps()
            if checkpoint_due:
                save_checkpoint(
                    self.engine,
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
        self._write_steps()

    def _grid_update_due(self, step: int) -> bool:
        t = self.cfg.training
        return (
            bool(t.grid_update_every)
            and step % t.grid_update_every == 0
            and (t.grid_update_until is None or step <= t.grid_update_until)
        )

    def _step(self, step: int, timer: StepTimer) -> None:
        """One training step, stamped by ``timer``; nothing in it waits for the device or the
        other ranks beyond what the backend itself does."""
        env, engine = self.env, self.engine
        inject_fault(self.cfg.fault, env.rank, step + 1)
        timer.start_step()
        batches, n_global = self.last_batches = self.source.batches(step)
        timer.data_ready()
        if self._grid_update_due(step):
            self._update_grid(self.plan.global_indices(step))
        engine.count_state_next_step = step == self.plan.total_steps - 1
        # Before the backward: under Accelerate's DeepSpeed plugin the last micro-batch's backward steps.
        set_lr(engine.optimizer, lr_at(self.cfg.training, step, self.plan.total_steps))
        started = time.perf_counter()
        with self.traffic.around(step):
            loss_share = engine.forward_backward(batches, self.cfg.task.loss_sum, n_global=n_global)
            if self.probe is not None:
                self.probe.after_backward(engine, batches, step)
            engine.step()
        self.step_lrs[step] = current_lr(engine.optimizer)  # what the step ran with, unless the backend changed it
        if engine.compilation is not None and step == self.start_step:
            # The whole step compiles in its first call: that call's time is the compile time
            # (a warm-up step, so it is in no timed window either way).
            self.compile_s = time.perf_counter() - started
        timer.end_step(loss_share, sum(len(x) for x, _ in batches))
        self.steps_done = step + 1

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

    def _write_steps(self) -> None:
        """Append the combined step records not yet in steps.jsonl (rank 0 writes; no collective)."""
        records = self.combined[self.written :]
        if not records:
            return
        if self.writer is not None:
            self.writer.append_steps(records)
        self.written = len(self.combined)
        last = records[-1]
        self.progress.update(self.steps_done, loss=last.loss, samples_per_s=last.samples / max(last.time_s_max, 1e-12))

    def _evaluate(self) -> dict[str, float]:
        """The task's test metrics of the trained model, each data-parallel rank evaluating a
        shard. Every rank runs the same number of forward passes, which sharded strategies need."""
        env, mesh, task = self.env, self.env.mesh, self.cfg.task
        n_test = self.data.x_test.shape[0]
        shard = torch.arange(n_test).tensor_split(mesh.dp_size)[mesh.dp_rank]
        chunk = max(self.micro_batch, 1024)
        n_chunks = max(1, math.ceil(math.ceil(n_test / mesh.dp_size) / chunk))
        sums = self.engine.evaluate(
            ((self.data.x_test[i], self.data.y_test[i]) for i in shard.tensor_split(n_chunks)), task.metric_sums
        )
        # The statistics may be of any shape (one per output): summed over ranks as one tensor.
        names = sorted(sums)
        parts = [sums[n].double().reshape(-1) for n in names]
        totals = (env.all_reduce(torch.cat(parts), "sum") / mesh.ranks_per_replica).cpu()
        return task.metrics(dict(zip(names, totals.split([len(p) for p in parts]))), n_test)

    def _fail(self, exc: BaseException) -> None:
        """Report this rank's failure and rewrite the record from this attempt's reports so far (any
        rank may be the last one able to), then write the completed steps not yet written. Ctrl-C,
        or a SIGTERM no rank's failure preceded, leaves the run ``incomplete``: stopped, not failed."""
        with reporting_failure():
            free_space(self.run_dir)  # on a full disk, the room for the report and the record
            report = FailureReport(
                rank=self.env.rank,
                step=self.steps_done,
                type=type(exc).__name__,
                message=str(exc) or type(exc).__name__,
                time=time.time(),
            )

            def write(error: RunError) -> None:
                status = "incomplete" if isinstance(exc, KeyboardInterrupt) or error.type == STOPPED else "failed"
                self.record = self.record.model_copy(
                    update=dict(
                        status=status, error=error, finished_at=now_iso(), batch=self._batch_info(error.step or 0)
                    )
                )
                (self.writer or RunWriter(self.run_dir)).write_summary(self.record)

            record_failure(
                reports_dir(self.run_dir, self.attempt.number),
                report,
                self.env.world_size,
                write,
                make_room=lambda: discard_partial_saves(self.run_dir),
            )
            # The steps after the record: the reserve holds room for the record, whose size is
            # bounded; how many steps are not yet written is not.
            if self.writer is not None:
                try:
                    self._write_steps()
                except OSError:
                    pass  # a full disk: they do not fit (append_steps leaves no torn line)


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
