"""Results where users already look: ``tracking.report_to: [tensorboard, mlflow]`` (the convention
of Accelerate's ``log_with``). Rank 0 hands each tracker, through the tracker's own library, what
the suite records: the run's resolved settings, every step's loss, learning rate, rate and exposed
communication, rank 0's resident memory as each window is written, and the run's results at its
end. The run record stays the suite's one source (docs/metrics.md); a tracker is a copy of it.

Where each writes: TensorBoard event files under ``OUT/<run_id>/tensorboard/``; MLflow to the
tracking URI the user set (``MLFLOW_TRACKING_URI``), else MLflow's file store at ``OUT/mlruns``, in an
experiment named after the suite's experiment, one MLflow run per suite run (named by its run id).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from analysis.records.schema import RunRecord, StepRecord
from kanscale import log
from kanscale.identity import dotted
from strategies.measure.memory import rss_bytes

logger = log.get(__name__)

# MLflow keeps a parameter's value to this many characters (its documented limit); longer ones are cut
MLFLOW_PARAM_CHARS = 6000


def step_scalars(step: StepRecord) -> dict[str, float]:
    """What a tracker plots of one step, by tag."""
    scalars = {"train/loss": step.loss, "train/samples_per_s": step.samples / max(step.time_s_max, 1e-12)}
    scalars["time/step_s"] = step.time_s_max
    if step.lr is not None:
        scalars["train/lr"] = step.lr
    if step.comm_s_max is not None:
        scalars["time/comm_exposed_s"] = step.comm_s_max
    return scalars


def run_results(record: RunRecord) -> dict[str, float]:
    """A run's results as a tracker keeps them (what the record has of them so far)."""
    results = {f"test_{name}": value for name, value in (record.test_metrics or {}).items()}
    if record.final_loss is not None:
        results["final_loss"] = record.final_loss
    if record.throughput is not None:
        results["samples_per_s"] = record.throughput.samples_per_s
    if record.memory is not None and record.memory.peak_rss_bytes is not None:
        results["peak_rss_bytes"] = record.memory.peak_rss_bytes
    if record.comm_overhead is not None:
        results["comm_overhead"] = record.comm_overhead
    return results


class Tracker(Protocol):
    def log_settings(self, settings: dict[str, Any]) -> None: ...
    def log_steps(self, steps: Sequence[StepRecord], memory_bytes: int) -> None: ...
    def log_results(self, results: dict[str, float], status: str) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_settings(self, settings: dict[str, Any]) -> None:
        # the settings as one text table (hparams would need a metric to pair them with)
        rows = "\n".join(f"| {key} | {value} |" for key, value in settings.items())
        self.writer.add_text("run/settings", f"| setting | value |\n|---|---|\n{rows}")

    def log_steps(self, steps: Sequence[StepRecord], memory_bytes: int) -> None:
        for step in steps:
            for tag, value in step_scalars(step).items():
                self.writer.add_scalar(tag, value, step.step)
        if steps:
            self.writer.add_scalar("memory/rank0_rss_bytes", memory_bytes, steps[-1].step)
        self.writer.flush()

    def log_results(self, results: dict[str, float], status: str) -> None:
        for tag, value in results.items():
            self.writer.add_scalar(f"results/{tag}", value, 0)
        self.writer.add_text("run/status", status)
        self.writer.close()


class MLflowTracker:
    def __init__(self, run_dir: Path, experiment: str) -> None:
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            # MLflow's file store: no server and no database library needed. MLflow 3 keeps it in
            # maintenance and asks for this opt-in; a user who sets a URI gets what they set.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir.parent / "mlruns").resolve().as_uri()
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_dir.name)

    def log_settings(self, settings: dict[str, Any]) -> None:
        self.mlflow.log_params({key: str(value)[:MLFLOW_PARAM_CHARS] for key, value in settings.items()})

    def log_steps(self, steps: Sequence[StepRecord], memory_bytes: int) -> None:
        for step in steps:
            self.mlflow.log_metrics({tag.replace("/", "."): v for tag, v in step_scalars(step).items()}, step=step.step)
        if steps:
            self.mlflow.log_metric("memory.rank0_rss_bytes", memory_bytes, step=steps[-1].step)

    def log_results(self, results: dict[str, float], status: str) -> None:
        self.mlflow.log_metrics({f"results.{tag}": value for tag, value in results.items()})
        self.mlflow.end_run(status="FINISHED" if status == "ok" else "FAILED")


class Trackers:
    """Every tracker the experiment asks for, on the rank that writes the record (none elsewhere)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @classmethod
    def open(cls, report_to: Sequence[str], run_dir: Path, experiment: str, settings: dict[str, Any]) -> Trackers:
        made: dict[str, Any] = {
            "tensorboard": lambda: TensorBoardTracker(run_dir),
            "mlflow": lambda: MLflowTracker(run_dir, experiment),
        }
        trackers = cls([made[name]() for name in report_to])
        flat = dotted(settings)
        for tracker in trackers.trackers:
            tracker.log_settings(flat)
        return trackers

    def log_steps(self, steps: Sequence[StepRecord]) -> None:
        if self.trackers and steps:
            memory = rss_bytes()
            self._each("log its steps", lambda tracker: tracker.log_steps(steps, memory))

    def log_results(self, results: dict[str, float], status: str) -> None:
        self._each("log the results", lambda tracker: tracker.log_results(results, status))
        self.trackers = []

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        """``call`` on every tracker; one that fails (a server gone, a full disk) is named once and
        dropped: the run and its record go on without it."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                logger.warning(
                    "tracking: %s could not %s (%s: %s); the run goes on without it",
                    type(tracker).__name__,
                    what,
                    type(exc).__name__,
                    exc,
                )
                self.trackers.remove(tracker)
