"""Settings that contradict each other, or the run's length, are refused before launch with the
fix, and the fix each refusal names is followed: a schedule whose decay ends before its warm-up,
a warm-up that starts at or above the peak, a warm-up or a decay the run's length cuts short,
grids never refitted, checkpoints never written. Each ran silently before."""

import pytest

from launchers.cli import main

RUN = ["run", "quickstart", "--strategy", "single", "--dry-run", "--set", "training.steps=20"]
DECAY = ["training.schedule.name=warmup_decay"]


def run_with(tmp_path, settings: list[str]) -> list[str]:
    return [*RUN, *(f for s in settings for f in ("--set", s)), "--out", str(tmp_path / "runs")]


@pytest.mark.parametrize(
    "settings, says, fix",
    [
        (
            [*DECAY, "training.schedule.warmup_steps=10", "training.schedule.total_steps=5"],
            "total_steps 5 is fewer than warmup_steps 10: the decay would end before the warm-up does",
            "training.schedule.total_steps=20",
        ),
        (
            [*DECAY, "training.schedule.warmup_steps=8", "training.schedule.total_steps=3"],
            "raise training.schedule.total_steps to at least 8",
            "training.schedule.total_steps=20",
        ),
        (
            ["training.schedule.name=warmup", "training.lr=0.01", "training.schedule.warmup_min_lr=0.01"],
            "schedule.warmup_min_lr 0.01 is not below lr 0.01: the warm-up would not rise",
            "training.schedule.warmup_min_lr=0",
        ),
        (
            ["training.schedule.name=warmup", "training.lr=0.01", "training.schedule.warmup_min_lr=0.5"],
            "lower training.schedule.warmup_min_lr",
            "training.lr=1.0",
        ),
        (
            ["training.grid_update_every=10", "training.grid_update_until=5"],
            "grid_update_until 5 comes before the first refit at step 10",
            "training.grid_update_every=0",
        ),
        (
            ["training.schedule.name=warmup", "training.schedule.warmup_steps=20"],
            "20 warm-up steps, but the run trains 20 optimizer steps",
            "training.schedule.warmup_steps=null",
        ),
        (
            ["training.schedule.name=warmup_cosine", "training.schedule.warmup_steps=50"],
            "lower warmup_steps below 20",
            "training.steps=60",
        ),
        (
            [*DECAY, "training.schedule.total_steps=12"],
            "reaches a learning rate of 0 at step 12, but the run trains 20 steps: its last 8",
            "training.schedule.total_steps=20",
        ),
        (
            ["training.checkpoint_every=50"],
            "every 50 steps, but the run trains 20: it would write no checkpoint",
            "training.checkpoint_every=20",
        ),
        (
            ["training.checkpoint_every=21"],
            "set training.checkpoint_every=20 (or lower) or 0 for none",
            "training.checkpoint_every=0",
        ),
    ],
)
def test_a_contradiction_is_refused_with_the_fix_that_then_runs(tmp_path, capsys, settings, says, fix):
    assert main(run_with(tmp_path, settings)) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert main(run_with(tmp_path, [*settings, fix])) == 0, capsys.readouterr().err  # the fix it names, followed
