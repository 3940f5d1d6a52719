"""Small runs trained in the test's own process, for the tests of what a run leaves on disk:
checkpoints, failures, resumes."""

from pathlib import Path

import pytest

from analysis.records.run_files import read_steps
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer
from strategies.runtime.distributed import DistEnv


def small(out: Path, strategy: dict | None = None, **training) -> dict:
    """A run of seconds: 12 steps, a checkpoint every 3 (the newest two kept: 6 and 9 when it
    fails at step 11)."""
    return {
        "name": "safety",
        "model": {"family": "bspline", "widths": [2, 4, 1], "grid": 3, "grid_range": [-2.0, 2.0]},
        "task": {"name": "quadratic", "n_train": 512, "n_test": 64},
        "training": {
            "seed": 3,
            "lr": 0.02,
            "micro_batch": 32,
            "steps": 12,
            "warmup_steps": 1,
            "checkpoint_every": 3,
            **training,
        },
        "strategy": strategy or {"name": "single"},
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def failing(config: dict, step: int = 11, rank: int | str = "all", kind: str = "exception") -> dict:
    return {**config, "fault": {"rank": rank, "step": step, "kind": kind}}


def failed_run(config: dict) -> Path:
    """The run directory of ``config`` trained here until its injected fault at step 11."""
    trainer = Trainer(parse_experiment(failing(config)), DistEnv(), show_progress=False)
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer.run()
    return trainer.run_dir


def losses(run_dir: Path) -> list[float]:
    return [s.loss for s in read_steps(run_dir)]
