"""`model.compile: true` in a real training run: the compile time is recorded apart from the
step times, and the compiled model trains like the eager one."""

from strategies.distributed import DistEnv
from strategies.experiment import parse_experiment
from strategies.loop import Trainer


def run(tmp_path, compile_model: bool):
    cfg = parse_experiment({
        "name": "compiled", "model": {"family": "bspline", "widths": [2, 8, 1], "grid": 5, "grid_range": [-2, 2],
                                      "compile": compile_model},
        "task": {"name": "quadratic", "n_train": 512, "n_test": 64},
        "training": {"micro_batch": 64, "steps": 8, "warmup_steps": 2, "lr": 0.01},
        "measurement": {"baseline_steps": 2}, "runtime": {"device": "cpu", "threads": 1}, "output": {"dir": str(tmp_path)},
    })
    trainer = Trainer(cfg, DistEnv(), show_progress=False)
    return trainer.run(), [s.loss for s in trainer.combined]


def test_compiled_training_matches_eager_and_reports_compile_time(tmp_path):
    eager, eager_losses = run(tmp_path, False)
    compiled, compiled_losses = run(tmp_path, True)
    assert eager.timings.compile_s is None
    assert compiled.timings.compile_s > 0.1
    assert compiled.timings.step_mean_s < compiled.timings.compile_s  # compiling is not in the step times
    for a, b in zip(compiled_losses, eager_losses):
        assert abs(a - b) <= 1e-4 * abs(b)
