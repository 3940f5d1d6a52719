"""The fused op's build ahead of time (kan_models/fused/build.py): the built op is loaded without
compiling, a stale lock from a killed build is cleared, and where the probe cannot build
(no compiler, no OpenMP) ``impl: fused`` is refused and ``impl: auto`` runs the fast layer with one
line saying why. Probes here run a stand-in compiler that fails at once: nothing is compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension
from pydantic import ValidationError

from kan_models import build_model, parse_model_config
from kan_models.bspline_fast import FastBSplineKANLayer
from kan_models.fused import FusedBSplineKANLayer
from kan_models.fused import build as fused_build
from launchers.cli import main as cli

NO_OPENMP = "fatal error: omp.h: No such file or directory"


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def plant_stale_locks(where: Path) -> None:
    """What a build killed midway leaves: this suite's lock naming a process that is gone, and
    cpp_extension's own, on which cpp_extension would wait forever."""
    where.mkdir(parents=True, exist_ok=True)
    (where / fused_build.LOCK).write_text(f"{fused_build.socket.gethostname()} {dead_pid()}\n")
    (where / "lock").touch()


@pytest.fixture
def compiler_without_openmp(tmp_path, monkeypatch):
    """A machine where nothing is built yet and the compiler finds no OpenMP header: a stand-in
    compiler that says so (and counts its calls), in an empty extensions folder."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "c++"
    compiler.write_text(
        "#!/bin/sh\n"
        'case "$*" in *.cpp*) ;; *) exec c++ "$@" ;; esac\n'  # asked its version: the real compiler's
        f"echo x >> {calls}\necho 'main.cpp:2:10: {NO_OPENMP}' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return calls


def test_the_built_op_is_loaded_and_not_compiled_again(monkeypatch):
    """The first call builds where the op is not built (once an environment); after it, building
    and loading compile nothing, as in a run after ``make install``."""
    path = fused_build.build()
    assert fused_build.is_built() and fused_build.fused_unavailable() is None

    def no_compiling(*args, **kwargs):
        raise AssertionError("the built op was compiled again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiling)
    assert fused_build.build() == path
    assert hasattr(fused_build._load(path), "layer")


def test_a_library_without_the_builds_end_mark_is_not_taken_as_built(tmp_path, monkeypatch):
    """A link killed midway leaves a library cut short, which crashes the process that loads it:
    only a build that finished (its mark written after it) counts."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    where = fused_build.build_directory()
    where.mkdir()
    fused_build.library(where).write_bytes(b"\x7fELF cut short")
    assert not fused_build.is_built()
    (where / fused_build.BUILT).write_text("done\n")
    assert fused_build.is_built()


def test_a_stale_lock_in_the_ops_folder_is_cleared_with_a_line(monkeypatch, capsys):
    fused_build.build()
    where = fused_build.build_directory()
    plant_stale_locks(where)
    fused_build.build()
    err = capsys.readouterr().err
    assert f"clearing a stale build lock in {where}" in err and "is no longer running" in err
    assert "clearing the lock a killed build left" in err
    assert not (where / fused_build.LOCK).exists() and not (where / "lock").exists()


def test_a_probe_builds_past_a_stale_lock_and_its_verdict_is_kept(compiler_without_openmp, capsys):
    plant_stale_locks(fused_build.probe_directory())
    reason = fused_build.fused_unavailable()
    assert reason and NO_OPENMP in reason and "log: " in reason
    assert "clearing a stale build lock" in capsys.readouterr().err
    calls = compiler_without_openmp.read_text()
    assert fused_build.fused_unavailable() == reason  # read from the verdict: not compiled again
    assert compiler_without_openmp.read_text() == calls


def test_without_openmp_fused_is_refused_and_auto_runs_the_fast_layer_saying_why(compiler_without_openmp, capsys):
    with pytest.raises(ValidationError, match=r"impl fused cannot be built here: .*omp\.h.*set impl=fast"):
        parse_model_config({"family": "bspline", "widths": [2, 4, 1], "impl": "fused"})
    config = parse_model_config({"family": "bspline", "widths": [2, 4, 1], "impl": "auto"})
    model = build_model(config, 0)
    assert all(type(layer) is FastBSplineKANLayer for layer in model.layers)
    model(torch.zeros(3, 2)).sum().backward()
    lines = [line for line in capsys.readouterr().err.splitlines() if "model.impl auto runs the fast layer" in line]
    assert len(lines) == 1 and NO_OPENMP in lines[0]
    build_model(config, 1)
    assert "model.impl auto" not in capsys.readouterr().err  # one line a process
    assert config.machine_choices("cpu")["impl"].startswith("fast: the fused B-spline op cannot be built here")


def test_build_ops_says_why_it_cannot_build_and_fails_unless_asked_only_if_possible(
    compiler_without_openmp, capsys, monkeypatch
):
    probes = []
    probe = fused_build._run_probe
    monkeypatch.setattr(fused_build, "_run_probe", lambda where: probes.append(where) or probe(where))
    assert cli(["build-ops"]) == 1
    assert NO_OPENMP in capsys.readouterr().err
    assert cli(["build-ops", "--if-possible"]) == 0
    assert "model.impl auto runs the fast layer" in capsys.readouterr().err
    assert len(probes) == 2  # each explicit build probes again: what it lacked may be installed since


def test_an_empty_lock_is_waited_for_while_young_and_cleared_when_old(tmp_path):
    lock = tmp_path / fused_build.LOCK
    lock.touch()
    assert fused_build._stale_holder(lock) is None  # its writer may be writing it now
    os.utime(lock, (0, 0))
    assert "left empty" in (fused_build._stale_holder(lock) or "")


def test_build_ops_says_where_the_built_op_is(capsys):
    fused_build.build()
    assert cli(["build-ops"]) == 0
    assert f"the fused B-spline op is built: {fused_build.build_directory()}" in capsys.readouterr().err


def test_a_fused_model_loads_the_op_when_it_is_built_not_in_its_first_step():
    fused_build.build()
    fused_build.extension.cache_clear()
    model = build_model(parse_model_config({"family": "bspline", "widths": [2, 4, 1], "impl": "fused"}), 0)
    assert isinstance(model.layers[0], FusedBSplineKANLayer)
    assert fused_build.extension.cache_info().currsize == 1
