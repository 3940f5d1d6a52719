"""The timing windows and the verdict on exposed communication; both timing modes in real runs."""

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from analysis.records.run_files import read_steps
from strategies.experiment import load_experiment
from strategies.loop.trainer import train
from strategies.measure.comm_exposure import NOISE_FLOOR, WindowTimes, exposure
from strategies.measure.timing import StepTimer, WindowSample, thread_clock, window_bounds
from strategies.runtime.distributed import DistEnv

ROOT = Path(__file__).resolve().parents[1]


def test_windows_keep_warmup_apart_and_end_at_checkpoints():
    assert window_bounds(0, 23, 5, 10) == [(0, 5), (5, 15), (15, 23)]
    assert window_bounds(0, 20, 0, 10, also_at=4) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    assert window_bounds(12, 30, 5, 10) == [(12, 22), (22, 30)]  # a resumed run starts where it left off
    assert window_bounds(0, 3, 1, 1) == [(0, 1), (1, 2), (2, 3)]


def windows(replica_ms: list[float], blocked_ms: list[float] | None, step_ms: float = 10.0) -> list[WindowTimes]:
    blocked = blocked_ms or [None] * len(replica_ms)
    return [
        WindowTimes(
            step_s=step_ms / 1e3, data_s=0.0, compute_s=(step_ms - r) / 1e3, blocked_s=None if b is None else b / 1e3
        )
        for r, b in zip(replica_ms, blocked, strict=True)
    ]


def test_methods_that_agree_within_noise_say_so():
    comm = exposure(windows([3.0, 3.4, 2.8], [3.1, 3.2, 3.0]), 0.01, check_valid=True)
    assert comm.agree and comm.trusted == "replica" and "agree" in comm.note
    assert comm.replica.median_s == pytest.approx(3.0e-3) and comm.replica.low_s == pytest.approx(2.8e-3)
    assert comm.noise_s >= NOISE_FLOOR * 0.01


def test_a_replica_figure_below_the_check_is_not_trusted():
    """A stale baseline makes the difference negative; it is recorded raw."""
    comm = exposure(windows([-1.0, -0.5, -0.8], [5.0, 5.2, 4.9]), 0.01, check_valid=True)
    assert not comm.agree and comm.trusted == "check" and comm.replica.median_s < 0
    assert "trust the check" in comm.note and comm.difference_s == pytest.approx(-5.7e-3)  # median of -6.0, -5.7, -5.7


def test_bookkeeping_beyond_the_waiting_is_named():
    comm = exposure(windows([8.0, 8.2, 7.9], [4.0, 4.1, 3.9]), 0.01, check_valid=True)
    assert not comm.agree and comm.trusted == "replica" and "CPU work on the critical path" in comm.note


def test_without_a_check_the_record_says_there_was_none():
    comm = exposure(windows([2.0, 2.5], None), 0.01, check_valid=True)
    assert comm.check is None and comm.agree is None and "replica method only" in comm.note
    assert exposure(windows([2.0], [2.0]), 0.01, check_valid=False).check is None  # several threads per rank


@pytest.mark.skipif(thread_clock() is None, reason="this kernel keeps no scheduler statistics")
def test_the_blocked_clock_does_not_count_sleeping_as_running():
    """A sleep is blocked time, not running: the sleep cannot end early, and what the thread ran
    around it (two clock reads) is far below it however loaded the machine is."""
    ran0, waited0 = thread_clock()
    start = time.perf_counter()
    time.sleep(0.2)
    elapsed = time.perf_counter() - start
    ran, waited = (b - a for a, b in zip((ran0, waited0), thread_clock(), strict=True))
    assert elapsed - ran - waited >= 0.2 * 0.95  # the margin: the clocks are read around the sleep, not at it
    assert ran < 0.1


def timed_window(steps: int, step: Callable[[], None], per_step: bool = False, after: float = 0.0) -> WindowSample:
    """One window of ``steps`` steps on a CPU, each running ``step``; ``after`` seconds of sleep
    after the last step, before the window closes."""
    timer = StepTimer(DistEnv.from_environ("cpu"), per_step=per_step)
    timer.start_window()
    for _ in range(steps):
        timer.start_step()
        timer.data_ready()
        step()
        timer.end_step(torch.zeros(()), 8)
    time.sleep(after)
    return timer.end_window()


def test_a_cpu_windows_wall_ends_with_its_last_step_not_with_the_closing_synchronize():
    """What follows the last step (on a CPU: the closing barrier, waiting for the slowest rank) is
    the clock's own: the window's wall is its steps' time. The second of sleep after the last step
    stands for that wait; a wall that counted it would be longer than it."""
    window = timed_window(2, lambda: time.sleep(0.02), after=1.0)
    steps = sum(s.time_s for s in window.steps)
    assert len(window.steps) == 2 and 0.04 <= steps <= window.wall_s < 1.0


@pytest.mark.parametrize("per_step", [False, True])
def test_a_windows_blocked_time_is_its_steps_sleeping_not_their_running(per_step):
    """The thread's clocks, read at each end of the window (or of every step, per_step): steps
    that sleep 30 ms and compute 30 ms were blocked for their sleep and not their computing,
    whichever way they are read. Waiting for a core under load is not blocking, so the bounds
    hold on a busy machine: at least the sleep, and less than the sleep and the computing."""
    if thread_clock() is None:
        pytest.skip("this kernel keeps no scheduler statistics (/proc/thread-self/schedstat)")

    def sleep_then_compute() -> None:
        time.sleep(0.03)
        busy_until = time.perf_counter() + 0.03
        while time.perf_counter() < busy_until:
            pass

    window = timed_window(3, sleep_then_compute, per_step=per_step)
    assert 0.03 * 0.95 <= window.blocked_s < 0.06  # the margin: the clocks are read around the sleep


def test_the_loop_benchmark_says_when_its_median_is_within_noise_of_the_target():
    """scripts/bench_timing.py: rounds that range from 0.83 to 1.11 give a median no test of 0.97
    can trust; tight rounds on either side decide it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_timing", ROOT / "scripts/bench_timing.py")
    spec.loader.exec_module(bench := importlib.util.module_from_spec(spec))
    median_interval, verdict = bench.median_interval, bench.verdict

    noisy = [1.034, 0.827, 1.109, 0.95, 0.99, 1.0, 0.93, 0.97, 1.05]
    low, high = median_interval(noisy)
    assert low < 0.97 < high and verdict(low, high).startswith("within noise")
    assert verdict(*median_interval([0.99, 0.98, 1.0, 0.985, 0.995])).startswith("met")
    assert verdict(*median_interval([0.93, 0.92, 0.94, 0.925, 0.935])).startswith("missed")
    assert median_interval([0.9]) == (0.9, 0.9)  # one round: its own value, no interval to speak of


@pytest.mark.parametrize("timing", ["windowed", "per_step"])
def test_both_timing_modes_record_what_they_did(tmp_path, timing):
    cfg = load_experiment(
        ROOT / "configs/experiments/quickstart.yaml",
        [
            f"output.dir={tmp_path}",
            "training.steps=27",
            "task.n_train=4000",
            f"measurement.timing={timing}",
            "measurement.window_steps=4",
        ],
    )
    result = train(cfg, show_progress=False)
    record, steps = result.record, read_steps(result.run_dir)
    assert record.measurement.timing == timing and record.measurement.window_steps == 4
    assert record.measurement.windows == 6  # steps 6-27 in windows of 4: 4+4+4+4+4+2
    assert [s.window for s in steps][:7] == [0, 0, 0, 0, 1, 2, 2]  # no window holds warm-up and timed steps
    assert all(s.compute_s > 0 for s in steps)
    assert (
        record.throughput.samples_per_s_low <= record.throughput.samples_per_s <= record.throughput.samples_per_s_high
    )
    assert record.topology.threads_per_rank == 1 and record.environment.cpu_count >= 1
    assert record.memory.replica_bytes is not None
