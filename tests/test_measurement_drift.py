"""Exposed communication on a machine whose speed changes during the run: CPU load that starts
halfway through. The compute baseline is sampled between timing windows, so it must follow the
load, and a run without communication must go on reading about none. A baseline timed once
before training (schema v2) would read the slowdown as communication."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.records.run_files import read_steps, read_summary
from tests.helpers.launch import child_env

# The slow tier (make test-slow, run by .ci/run): training under a deliberate load, timed window by window.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
# Steps several times longer than the scheduler's time slice: a step of the loaded run then spans
# the hogs' slices too, so each one slows by the core's share. A step shorter than a slice can fit
# inside one, and the median of such steps barely reads the load.
MICRO_BATCH = 2048
HOGS = 2  # busy processes on the training's core: it gets about a third of it
# The run and the hogs share one core, so the load is the same whatever CI's machine has: unpinned
# hogs on a machine with spare cores may slow nothing.
CORE = max(os.sched_getaffinity(0))


def on_the_core() -> None:
    os.sched_setaffinity(0, {CORE})


def start_hogs() -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=on_the_core) for _ in range(HOGS)]


@pytest.fixture(scope="module")
def loaded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("drift")
    cmd = [
        sys.executable,
        "-m",
        "launchers.cli",
        "train",
        "quickstart",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        f"training.steps={STEPS}",
        "--set",
        "training.log_every=10",
        "--set",
        f"training.micro_batch={MICRO_BATCH}",
        "--set",
        f"task.n_train={STEPS * MICRO_BATCH}",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=on_the_core,
    )
    hogs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            written = list(out.glob("*/steps.jsonl"))
            if written and len(written[0].read_text().splitlines()) >= STEPS // 2:
                hogs = start_hogs()
                break
            time.sleep(0.05)
        assert hogs, "the run ended before the load could start: " + (proc.stderr.read() if proc.poll() else "")
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    finally:
        for hog in hogs:
            hog.kill()
        proc.kill()
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return read_summary(run_dir), read_steps(run_dir)


def halves(steps):
    timed = [s for s in steps if s.timed]
    return timed[: len(timed) // 3], timed[-len(timed) // 3 :]  # well before the load, well into it


def test_the_load_slowed_the_training(loaded_run):
    _, steps = loaded_run
    before, during = halves(steps)
    ratio = statistics.median(s.time_s_max for s in during) / statistics.median(s.time_s_max for s in before)
    print(f"step time under load / before: {ratio:.2f}")
    assert ratio > 1.4  # without this the test below would prove nothing


def test_the_compute_baseline_follows_the_load(loaded_run):
    _record, steps = loaded_run
    before, during = halves(steps)
    compute_ratio = statistics.median(s.compute_s for s in during) / statistics.median(s.compute_s for s in before)
    step_ratio = statistics.median(s.time_s_max for s in during) / statistics.median(s.time_s_max for s in before)
    print(f"baseline under load / before: {compute_ratio:.2f} (steps: {step_ratio:.2f})")
    # A baseline fixed before the load would read 1.0 against the steps' slowdown. The baseline is
    # two replica steps per window, each a few of the scheduler's slices long, so its ratio scatters
    # around the steps': it must follow at least half the slowdown, and not exceed twice it.
    assert 1 + (step_ratio - 1) / 2 < compute_ratio < 2 * step_ratio


def test_a_run_without_communication_still_reads_about_none(loaded_run):
    record, steps = loaded_run
    step = record.timings.step_mean_s
    comm = record.comm
    print(json.dumps(comm.model_dump(), indent=1))
    assert abs(comm.replica.median_s) < 0.15 * step
    # Waiting for a core is not blocking: the check reads about 0, and a reading below 0 is not
    # kept as a measurement (the note names it).
    assert comm.check.median_s < 0.05 * step if comm.check is not None else "check method read" in comm.note
    assert record.comm_overhead is None or record.comm_overhead < 0.15
    # What a baseline timed once, before the load, would have made of the loaded steps:
    before, during = halves(steps)
    fixed = statistics.median(s.compute_s for s in before)
    loaded_step = statistics.median(s.time_s_max for s in during)
    stale = loaded_step - fixed
    print(
        f"steps {1e3 * statistics.median(s.time_s_max for s in before):.2f} -> {1e3 * loaded_step:.2f} ms, "
        f"baseline {1e3 * fixed:.2f} -> {1e3 * statistics.median(s.compute_s for s in during):.2f} ms; "
        f"a baseline fixed before the load would call {stale / loaded_step:.0%} of a loaded step communication"
    )
    assert stale > 0.3 * loaded_step
