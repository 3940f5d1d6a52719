"""A run's output is not buried in libraries' deprecation notices: each kind is shown once, on
one line, while every other warning (the suite's own among them) is shown as before; a DeepSpeed
run on a CPU compiles nothing; and what a process compiles lives in its virtual environment."""

import json
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from kanscale.extensions import environment_cache
from tests.helpers.launch import child_env

ROOT = Path(__file__).resolve().parents[1]
DEPRECATION = re.compile(r": (FutureWarning|DeprecationWarning|PendingDeprecationWarning): (.*)$")

# What torch and DeepSpeed do in a run: the same notice again after the warnings registry is
# reset (any warnings.catch_warnings() resets it), and an unrelated warning beside it.
NOTICES = textwrap.dedent("""
    import warnings
    from kanscale.warnings_once import show_warnings_once

    show_warnings_once()
    show_warnings_once()  # a second install adds nothing
    for _ in range(3):
        with warnings.catch_warnings():
            pass
        warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)
        warnings.warn("`reduce_scatter_tensor` is deprecated", FutureWarning)
        warnings.warn("the suite's own warning", UserWarning)
""")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_each_deprecation_kind_is_shown_once_on_one_line_by_the_reporting_rank(rank):
    proc = subprocess.run(
        [sys.executable, "-c", NOTICES],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(RANK=rank),
        check=True,
    )
    lines = proc.stderr.splitlines()
    notices = [line for line in lines if DEPRECATION.search(line)]
    if rank == "0":
        assert [DEPRECATION.search(line).group(2) for line in notices] == [
            "`all_gather_into_tensor` is deprecated",
            "`reduce_scatter_tensor` is deprecated",
        ]
        assert not any(line.startswith("  warnings.warn(") for line in lines)  # no source line under them
    else:
        assert notices == []  # every rank holds the same libraries: rank 0 says it
    assert sum("UserWarning: the suite's own warning" in line for line in lines) == 3  # untouched


@pytest.mark.slow  # a 2-rank DeepSpeed run
def test_a_zero2_run_builds_nothing_and_shows_each_library_deprecation_once_and_the_suites_own_warning(tmp_path):
    native = json.loads((ROOT / "configs/deepspeed/zero2.json").read_text())
    native["flops_profiler"] = {"enabled": False}  # a key the suite does not check
    (tmp_path / "ds.json").write_text(json.dumps(native))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launchers.cli",
            "run",
            "quickstart",
            "--deepspeed-config",
            str(tmp_path / "ds.json"),
            "--nproc-per-node",
            "2",
            "--set",
            "training.steps=6",
            "--set",
            "training.warmup_steps=1",
            "--out",
            str(tmp_path / "runs"),
        ],
        cwd=ROOT,
        env=child_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), CXX="no-such-c++"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # nothing compiled, so nothing to wait for or to fail without a compiler (CXX names none)
    assert not (tmp_path / "extensions").exists() or not any((tmp_path / "extensions").iterdir())
    kinds = Counter(m.groups() for m in map(DEPRECATION.search, proc.stderr.splitlines()) if m)
    assert kinds, proc.stderr[-4000:]  # torch's notices about the collectives DeepSpeed calls
    assert all(count == 1 for count in kinds.values()), kinds
    assert "UncheckedDeepSpeedKeys" in proc.stderr and "flops_profiler" in proc.stderr


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not run from a virtual environment")
def test_the_suites_processes_keep_their_builds_in_their_virtual_environment(tmp_path):
    """Run from a virtual environment without TORCH_EXTENSIONS_DIR, the entry point sets it inside
    that environment, and puts the environment's ninja first on PATH (the ranks it starts inherit
    both); a TORCH_EXTENSIONS_DIR that is set stays as it is."""
    probe = (
        "import os, runpy, sys; sys.argv = ['kanscale', '--version']\n"
        "try:\n    runpy.run_module('launchers.cli', run_name='__main__')\n"
        "except SystemExit:\n    print(os.environ.get('TORCH_EXTENSIONS_DIR'), os.environ['PATH'].split(':')[0])\n"
    )
    env = {**child_env(), "PATH": "/usr/bin:/bin"}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    unset = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    extensions, first_on_path = unset.stdout.splitlines()[-1].split()
    assert extensions == str(environment_cache(Path(sys.prefix)))
    tools = Path(sys.executable).parent
    assert first_on_path == (str(tools) if (tools / "ninja").is_file() else "/usr/bin")
    chosen = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert chosen.stdout.splitlines()[-1].split()[0] == str(tmp_path)


def test_an_environment_reached_through_a_link_keeps_its_builds_apart(tmp_path):
    """A worktree's .venv linked to the checkout's compiles with other include paths: sharing
    one folder, each would rebuild the other's ops."""
    (tmp_path / "venv").mkdir()
    (tmp_path / "worktree_venv").symlink_to(tmp_path / "venv")
    own, linked = environment_cache(tmp_path / "venv"), environment_cache(tmp_path / "worktree_venv")
    assert own == tmp_path / "venv/torch_extensions"
    assert linked.resolve().parent == own.resolve() and linked.resolve() != own.resolve()
