import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Two CPU cores on CI: keep each test process to one intra-op thread so distributed tests
# (two ranks) do not oversubscribe.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What a developer measured on this machine (the sparse product's crossover) stays out of the tests:
# they, and the processes they start, see an empty cache and the shipped defaults.
os.environ["KANSCALE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kanscale-test-cache-")


# The files that take longest (the --durations of a fresh clone's .ci/run, slow and fast tier).
# Under pytest-xdist's loadfile each file runs whole on one worker, in collection order: these go
# first, so that no worker is left running one of them alone while the other has finished.
LONGEST_FIRST = (
    "test_docs_commands_run.py",
    "test_rehearsal.py",
    "test_baseline_memory.py",
    "test_activation_checkpointing.py",
    "test_recommend.py",
    "test_extras_install.py",
    "test_full_disk.py",
    "test_compile_training.py",
    "test_parity.py",
    "test_tensor_parallel.py",
    "test_recommend_rehearsed.py",
    "test_device_time.py",
    "test_projection.py",
    "test_run_lock.py",
    "test_analysis.py",
    "test_sweep.py",
    "test_sweep_interrupts.py",
    "test_hybrid_sharding.py",
    "test_precision.py",
    "test_hf_templates.py",
    "test_reliability.py",
    "test_backends_cli.py",
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's own order kept


@pytest.fixture
def in_tmp_cwd(tmp_path, monkeypatch):
    """Run a test inside an empty working directory (to catch stray files)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def fresh_command_state():
    """Each test starts as a fresh ``kanscale`` process does: tests call the CLI's ``main`` in this
    process, and a ``-q`` there (the log level it exports for ranks) or a warning it showed (the
    kinds recorded as shown, so ranks do not repeat them) would otherwise reach the next test and
    the processes it starts."""
    from kanscale import log, warnings_once

    saved = {name: os.environ.get(name) for name in (log.LEVEL_VARIABLE, warnings_once.SHOWN_VARIABLE)}
    level = logging.getLogger(log.ROOT).level
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    logging.getLogger(log.ROOT).setLevel(level)


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory) -> tuple[Path, str]:
    """The checkout built into a wheel once a session, and what the build printed: the packaging
    tests read both, the plain-install test installs it."""
    work = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work), str(root)]
    build = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = work.glob("kanscale-*.whl")
    return wheel, build.stdout + build.stderr


@pytest.fixture(scope="session")
def state_runs(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """The records of short real runs of every CPU strategy under fp32 and bf16
    (tests/helpers/state_runs.py), shared by the projection's and the rehearsal's tests."""
    from tests.helpers.state_runs import run_state_runs

    return run_state_runs(tmp_path_factory.mktemp("state"))
