"""A plain (not editable) install works away from the checkout: the wheel builds without a
setuptools warning and holds every data file the packages read (the shipped configs, the schema
JSONs, the reference table), presets resolve by name, and ``kanscale --version`` answers."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# The slow tier (make test-slow, run by .ci/run): the package built and installed into a fresh environment.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


# The source folders of the wheel's packages, and where each lands in it.
IN_WHEEL = {
    "analysis": "analysis",
    "kan_models": "kan_models",
    "kanscale": "kanscale",
    "launchers": "launchers",
    "strategies": "strategies",
    "configs": "kanscale/configs",
}


@pytest.fixture(scope="module")
def built(project_wheel) -> tuple[Path, str]:
    """The project built into a wheel (once a session: tests/conftest.py), and what the build printed."""
    return project_wheel


def test_the_wheel_builds_without_a_setuptools_warning(built):
    _, output = built
    warned = [line for line in output.splitlines() if "warning" in line.lower()]
    assert not warned, "\n".join(warned)  # e.g. "Package would be ignored", "project.license as a TOML table"


def test_the_editable_install_make_install_does_is_quiet(tmp_path):
    """``make install`` installs the checkout editable: pip runs setuptools' build_editable, and
    what it prints reaches the user (a package-dir mapping once made it warn on every install)."""
    # -W error: any warning the backend gives (setuptools' InformationOnly included) fails the build
    build = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            "import sys, setuptools.build_meta as backend; print(backend.build_editable(sys.argv[1]))",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("kanscale-*.whl")
    finders = [name for name in zipfile.ZipFile(wheel).namelist() if "finder" in name]
    assert not finders, finders  # a path entry in a .pth, not setuptools' import finder


def test_the_wheel_holds_every_data_file_of_its_packages(built):
    wheel, _ = built
    held = set(zipfile.ZipFile(wheel).namelist())
    data = {
        f"{into}/{path.relative_to(ROOT / source).as_posix()}"
        for source, into in IN_WHEEL.items()
        for path in (ROOT / source).rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }
    assert {
        "analysis/records/run_record.schema.json",
        "kanscale/configs/studies/demo_cpu.yaml",
    } <= data  # what it looks at
    assert sorted(data - held) == []


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """The wheel installed (without dependencies, which this environment has) into a directory of its own."""
    wheel, _ = built
    work = tmp_path_factory.mktemp("site")
    target = work / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return target


def kanscale(target: Path, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script the wheel installed, run from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(target / "bin" / "kanscale"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_installed_package_is_the_one_that_runs(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kanscale.files, strategies; print(strategies.__file__); print(kanscale.files.configs_dir())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in where), where
    assert (Path(where[1]) / "strategies/zero3.yaml").is_file()


def test_presets_resolve_outside_a_checkout(installed, tmp_path):
    version = kanscale(installed, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.startswith("kanscale ")
    trained = kanscale(
        installed,
        tmp_path,
        "train",
        "quickstart",
        "--strategy",
        "single",
        "--no-progress",
        "--set",
        "training.steps=6",
        "--set",
        "training.warmup_steps=1",
        "--out",
        str(tmp_path / "runs"),
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "quickstart-bspline-2x16x1-single-p1" in trained.stdout
    planned = kanscale(
        installed,
        tmp_path,
        "run",
        "quickstart",
        "--strategy",
        "zero3",
        "--nproc-per-node",
        "2",
        "--dry-run",
        "--out",
        str(tmp_path / "runs"),
    )
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "--strategy zero3" in planned.stdout
    studies = kanscale(
        installed, tmp_path, "sweep", "configs/studies/demo_cpu.yaml", "--out", str(tmp_path / "s"), "--dry-run"
    )
    assert studies.returncode == 0, studies.stderr[-3000:]
