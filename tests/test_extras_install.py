"""``pip install kanscale`` without extras, into a fresh virtual environment, trains a DDP and an
FSDP2 experiment at two ranks, and has none of the extras' packages. tests/test_extras.py
checks, in seconds, what a feature that needs an extra says when it is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.records.run_files import read_summary

# The slow tier (make test-slow, run by .ci/run): torch, DeepSpeed, Accelerate and the rest installed anew.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("kan", "sklearn", "pyarrow", "transformers")  # the modules of pykan, scikit-learn, pyarrow, transformers


def torch_spec() -> str:
    """The torch build make install installs (its TORCH_SPEC), which pip may find locally."""
    default = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert default, "the Makefile sets TORCH_SPEC"
    return os.environ.get("TORCH_SPEC", default.group(1))


def step(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    said = f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}\n{said}"
    return done


@pytest.fixture(scope="module")
def plain(tmp_path_factory, project_wheel) -> tuple[Path, dict[str, str]]:
    """A fresh virtual environment with torch, then kanscale's wheel without extras; and the
    environment its commands run in (nothing of this checkout on the path)."""
    work = tmp_path_factory.mktemp("plain")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    wheel, _ = project_wheel
    step([sys.executable, "-m", "venv", str(work / "venv")], work, env, 120)
    python = str(work / "venv/bin/python")
    # one resolution: torch pinned to the build make install chose, the wheel's dependencies beside it
    step([python, "-m", "pip", "install", "-q", torch_spec(), str(wheel)], work, env, 1200)
    env["PATH"] = f"{work / 'venv/bin'}{os.pathsep}{env.get('PATH', '')}"
    return work / "venv", env


def test_none_of_the_extras_packages_is_installed(plain):
    venv, env = plain
    found = step(
        [
            str(venv / "bin/python"),
            "-c",
            f"import importlib.util as u; print([m for m in {EXTRAS_ONLY!r} if u.find_spec(m)])",
        ],
        venv,
        env,
        60,
    )
    assert found.stdout.strip() == "[]", found.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_train_at_two_ranks_without_extras(plain, strategy, tmp_path):
    venv, env = plain
    step(
        [
            str(venv / "bin/kanscale"),
            "run",
            "quickstart",
            "--strategy",
            strategy,
            "--nproc-per-node",
            "2",
            "--set",
            "training.steps=6",
            "--set",
            "training.warmup_steps=1",
            "--out",
            str(tmp_path / "runs"),
            "-q",
        ],
        tmp_path,
        env,
        600,
    )
    (run,) = (tmp_path / "runs").iterdir()
    record = read_summary(run)
    assert record.status == "ok" and record.strategy.name == strategy and record.topology.world_size == 2
