"""What the suite says on stderr, as a user's shell sees it: ``-q`` keeps warnings and errors and
drops progress, in the launcher and in the ranks it starts; ``-v`` adds debug messages; each of
the suite's own warnings is one line, shown once per launch, without a source path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, child_env

THREADS_WARNING = "kanscale: warning: ThreadsBeyondCores: runtime.threads:"


def kanscale(*words: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launchers.cli", *words],
        cwd=ROOT,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quiet_drops_progress_before_or_after_the_subcommand_and_keeps_errors(tmp_path):
    schema = tmp_path / "schema.json"
    said = kanscale("schema", "--out", str(schema))
    assert said.returncode == 0 and said.stderr == f"wrote {schema}\n"
    for words in (["-q", "schema", "--out", str(schema)], ["schema", "--out", str(schema), "--quiet"]):
        quiet = kanscale(*words)
        assert quiet.returncode == 0 and quiet.stderr == "", words
    refused = kanscale("-q", "train", str(tmp_path / "missing.yaml"))
    assert refused.returncode == 2 and refused.stderr.startswith("kanscale: error: ")


def a_run(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """A short one-process run (launched: the rank is a process of its own) that asks for more
    threads than the machine has cores, which the launcher and the rank both check."""
    threads = str((os.cpu_count() or 1) + 1)
    words = ["run", "quickstart", "--set", f"runtime.threads={threads}", "--set", "training.steps=2"]
    done = kanscale(*flags, *words, "--set", "training.warmup_steps=1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow  # a launch as users start one: the slow tier's
def test_quiet_reaches_the_ranks_and_each_warning_is_one_line_once(tmp_path):
    quiet = a_run(tmp_path / "quiet", "-q")
    assert "run " in quiet.stdout  # the summary is a result: on stdout, at any verbosity
    warnings = [line for line in quiet.stderr.splitlines() if "ThreadsBeyondCores" in line]
    assert len(warnings) == 1 and warnings[0].startswith(THREADS_WARNING), quiet.stderr
    assert ".py:" not in quiet.stderr and "check_threads(" not in quiet.stderr  # no source path or line
    assert "[kanscale] step" not in quiet.stderr  # the rank's progress, quiet as the launcher was told


@pytest.mark.slow  # a launch as users start one: the slow tier's
def test_verbose_shows_the_commands_a_launch_starts_beside_the_progress(tmp_path):
    verbose = a_run(tmp_path / "verbose", "-v")
    assert "starting 1 command(s):" in verbose.stderr and "launchers.cli train quickstart" in verbose.stderr
    assert "[kanscale] step 2/2" in verbose.stderr
    assert sum("ThreadsBeyondCores" in line for line in verbose.stderr.splitlines()) == 1
