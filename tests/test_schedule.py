"""training.schedule: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, step for step as
DeepSpeed's own classes give them, applied the same way by every backend (per-step learning rate
and loss equal to the one-process run's, real gloo ranks), and continued exactly by a resume."""

import math
import re
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

from analysis.records.run_files import read_steps
from kanscale.errors import ConfigError
from strategies.experiment import parse_experiment
from strategies.loop.trainer import Trainer, find_resumable
from strategies.runtime.distributed import DistEnv
from strategies.sections import TrainingConfig
from strategies.step.schedule import lr_at
from tests.helpers.launch import run_jobs

PEAK, STEPS = 0.02, 16


def deepspeeds_lrs(name: str, warmup_type: str, steps: int, warmup: int, total: int) -> list[float]:
    """The learning rate of each optimizer step as DeepSpeed's engine runs its scheduler: read
    what the optimizer steps with, then step the scheduler (DeepSpeedEngine._take_model_step)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    common = {"warmup_num_steps": warmup, "warmup_type": warmup_type}
    scheduler = {
        "warmup": lambda: WarmupLR(optimizer, warmup_min_lr=0.001, warmup_max_lr=PEAK, **common),
        "warmup_decay": lambda: WarmupDecayLR(optimizer, total, warmup_min_lr=0.001, warmup_max_lr=PEAK, **common),
        "warmup_cosine": lambda: WarmupCosineLR(optimizer, total, warmup_min_ratio=0.1, cos_min_ratio=0.01, **common),
    }[name]()
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("name", ["warmup", "warmup_decay", "warmup_cosine"])
def test_each_step_has_deepspeeds_learning_rate(name, warmup_type):
    # the run goes past total_steps, where DeepSpeed's decay stops at its floor
    training = TrainingConfig(
        lr=PEAK,
        steps=STEPS,
        schedule={
            "name": name,
            "warmup_steps": 4,
            "warmup_type": warmup_type,
            "total_steps": 12,
            "warmup_min_lr": 0.001,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
        },
    )
    ours = [lr_at(training, step, STEPS) for step in range(STEPS)]
    theirs = deepspeeds_lrs(name, warmup_type, STEPS, warmup=4, total=12)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert len(set(ours)) > 3  # a schedule, not a constant


def test_defaults_warm_up_over_a_tenth_of_the_run_and_decay_to_its_end():
    training = TrainingConfig(lr=PEAK, steps=40, schedule={"name": "warmup_decay", "warmup_type": "linear"})
    ours = [lr_at(training, step, 40) for step in range(40)]
    assert ours == pytest.approx(deepspeeds_lrs_with_min_zero(40, warmup=4, total=40))
    assert TrainingConfig(lr=PEAK, steps=40).schedule.name == "constant"
    assert {lr_at(TrainingConfig(lr=PEAK, steps=40), step, 40) for step in range(40)} == {PEAK}


def deepspeeds_lrs_with_min_zero(steps: int, warmup: int, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = WarmupDecayLR(
        optimizer, total, warmup_min_lr=0.0, warmup_max_lr=PEAK, warmup_num_steps=warmup, warmup_type="linear"
    )
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def test_compiling_the_step_under_a_schedule_is_refused_and_compile_model_is_the_way():
    schedule = {"name": "warmup", "warmup_steps": 4}
    with pytest.raises(ValueError, match="schedule warmup would recompile it every step; use compile model"):
        TrainingConfig(steps=8, compile="step", schedule=schedule)
    assert TrainingConfig(steps=8, compile="model", schedule=schedule).compile == "model"


# ------------------------------------------------------------------------ real runs

MODEL = {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "grid_range": [-2.0, 2.0]}
SCHEDULE = {"name": "warmup_decay", "warmup_steps": 4, "warmup_type": "linear"}
BACKENDS = {
    "ddp": {"name": "ddp"},
    "fsdp1": {"name": "fsdp1"},
    "fsdp2": {"name": "fsdp2"},
    "zero0": {"name": "deepspeed", "zero_stage": 0},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "zero3_offload": {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": True},
    "accelerate": {"name": "accelerate"},
    "tp": {"name": "tp"},
}
RTOL = 1e-5  # the parity tests' tolerance


def experiment(strategy: dict, out: Path, steps: int = 10, **training) -> dict:
    return {
        "name": "schedule",
        "model": MODEL,
        "task": {"name": "quadratic", "n_train": 640, "n_test": 64},
        "training": {
            "seed": 2,
            "lr": 0.02,
            "micro_batch": None,
            "global_batch": 64,
            "steps": steps,
            "warmup_steps": 1,
            "schedule": SCHEDULE,
            **training,
        },
        "strategy": strategy,
        "measurement": {"baseline_steps": 1},
        "runtime": {"device": "cpu", "threads": 1},
        "output": {"dir": str(out)},
    }


def one_process(cfg: dict, resume: bool = False) -> Trainer:
    parsed = parse_experiment({**cfg, "strategy": {"name": "single"}})
    trainer = Trainer(parsed, DistEnv(), show_progress=False, resume=find_resumable(parsed, 1) if resume else None)
    trainer.run()
    return trainer


def lrs_and_losses(run_dir: str) -> tuple[list[float], list[float]]:
    steps = read_steps(Path(run_dir))
    return [s.lr for s in steps], [s.loss for s in steps]


def assert_same_schedule(run_dir: str, reference: Trainer) -> None:
    lrs, losses = lrs_and_losses(run_dir)
    assert lrs == [s.lr for s in reference.combined]  # the same float on every backend
    assert losses == pytest.approx([s.loss for s in reference.combined], rel=RTOL)


def test_one_process_warms_up_then_decays_and_trains(tmp_path):
    """The reference every backend is held to (tests below): each step's lr is the schedule's."""
    reference = one_process(experiment({"name": "single"}, tmp_path / "single"))
    lrs = [s.lr for s in reference.combined]
    expected = [lr_at(parse_experiment(experiment({"name": "single"}, tmp_path)).training, s, 10) for s in range(10)]
    assert lrs == expected and lrs[0] == 0.0 and max(lrs) == 0.02 and lrs[-1] < lrs[5]  # warm-up, then decay
    assert reference.combined[-1].loss < 0.8 * reference.combined[0].loss  # it trains


@pytest.mark.slow  # every backend in one launch (about a minute here)
def test_every_backend_steps_with_the_one_process_learning_rates(tmp_path):
    reference = one_process(experiment({"name": "single"}, tmp_path / "single"))
    results = run_jobs(
        [{"id": key, "config": experiment(strategy, tmp_path / "runs")} for key, strategy in BACKENDS.items()], tmp_path
    )
    for key in BACKENDS:
        assert results[key]["status"] == "ok" and results[key]["ranks_identical"], key
        assert_same_schedule(results[key]["run_dir"], reference)


def interrupted(cfg: dict, step: int) -> dict:
    return {**cfg, "fault": {"rank": "all", "step": step, "kind": "exception"}}


def test_a_run_resumed_mid_warmup_continues_the_schedule_exactly(tmp_path):
    cfg = experiment(
        {"name": "single"}, tmp_path, steps=12, checkpoint_every=3, schedule={**SCHEDULE, "warmup_steps": 8}
    )
    full = one_process(cfg)
    with pytest.raises(RuntimeError, match="injected fault"):
        one_process(interrupted(cfg, step=5))  # checkpoint at step 3, inside the 8-step warm-up
    resumed = one_process(cfg, resume=True)
    assert resumed.record.resumed_at_steps == [3]
    assert [s.lr for s in resumed.combined] == [s.lr for s in full.combined]
    assert [s.loss for s in resumed.combined] == [s.loss for s in full.combined]
    assert (
        math.isclose(full.combined[3].lr, lr_at(parse_experiment(cfg).training, 3, 12)) and full.combined[3].lr < 0.02
    )


def test_the_schedule_section_refuses_what_deepspeed_would(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("training.schedule.warmup_steps")):
        parse_experiment(experiment({"name": "single"}, tmp_path, schedule={"name": "warmup", "warmup_steps": 0}))
