"""Studies expand into the right points, each once; sweeps run them for real, go on past failures, resume;
one sweep at a time owns an output directory, and a point's run is its own."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from analysis.records.run_files import read_summary
from kanscale.errors import ConfigError
from launchers.cli import main
from launchers.studies.study import expand, load_study
from launchers.studies.sweep import SweepLock, matches
from tests.helpers.cli import refused
from tests.helpers.launch import child_env
from tests.helpers.records import make_record, write_record

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/experiments/quickstart.yaml"
STUDIES = sorted((ROOT / "configs/studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_shipped_studies_load_and_expand(path):
    study = load_study(path)
    points, _ = expand(study)
    assert points and study.preset in ("cpu", "paper")
    if study.preset == "cpu":  # this machine's 2 cores: 4 ranks only where the study says to oversubscribe
        limit = 4 if "oversubscribe" in study.description else 2
        assert max(p.world_size for p in points) <= limit and study.launcher != "slurm"
    else:
        assert study.launcher == "slurm" and max(p.world_size for p in points) >= 4


def test_the_five_studies_have_both_presets():
    names = {p.stem for p in STUDIES}
    for study in ("strong", "weak", "comm", "model_size", "memory"):
        assert {f"{study}_cpu", f"{study}_paper"} <= names


def test_paper_presets_are_the_published_setup():
    strong = load_study(ROOT / "configs/studies/strong_paper.yaml")
    points, _ = expand(strong)
    assert {(p.nodes, p.procs_per_node) for p in points} == {(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)}
    assert "task.n_train=100000" in points[0].overrides and "training.epochs=40" in points[0].overrides
    weak, _ = expand(load_study(ROOT / "configs/studies/weak_paper.yaml"))
    eight = next(p for p in weak if p.world_size == 8)
    assert "task.n_train=200000" in eight.overrides  # 25,000 per GPU


def test_memory_study_reaches_tens_of_millions_of_parameters():
    from kan_models import build_model, count_parameters, parse_model_config

    study = load_study(ROOT / "configs/studies/memory_cpu.yaml")
    widths = [size["model.widths"] for size in study.matrix["size"]]
    largest = count_parameters(
        build_model(parse_model_config({"family": "bspline", "widths": widths[-1], "grid": 10}), 0)
    )
    assert largest.trainable > 10_000_000


def write_study(tmp_path, **changes) -> Path:
    study = {
        "study": "tiny",
        "preset": "cpu",
        "experiment": str(ROOT / "configs/experiments/quickstart.yaml"),
        "launcher": "torchrun",
        "set": {"training.steps": 8, "training.micro_batch": 64, "measurement.baseline_steps": 2},
        "matrix": {"strategy": ["ddp", "zero2"], "topology": ["1x2"]},
        "include": [{"strategy": "single", "topology": "1x1"}],
        **changes,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def test_expansion_per_rank_bundles_and_skips(tmp_path):
    study = load_study(
        write_study(
            tmp_path,
            per_rank={"task.n_train": 100},
            matrix={
                "strategy": ["single", "ddp"],
                "topology": ["1x1", "1x2"],
                "size": [{"label": "big", "model.widths": [2, 32, 1], "model.grid": 7}],
            },
        )
    )
    points, skipped = expand(study)
    assert [p.key for p in points] == [
        "strategy=single_topology=1x1_size=big",
        "strategy=ddp_topology=1x1_size=big",
        "strategy=ddp_topology=1x2_size=big",
        "strategy=single_topology=1x1",
    ]
    assert skipped == ["strategy=single with topology 1x2: single runs one process"]
    two = points[2]
    assert (
        "task.n_train=200" in two.overrides
        and "model.grid=7" in two.overrides
        and "model.widths=[2, 32, 1]" in two.overrides
    )
    assert matches(two, ["strategy=ddp", "topology=1x2"]) and not matches(two, ["strategy=zero2"])
    repeated, _ = expand(load_study(write_study(tmp_path, repeats=2, include=[])))
    # repeats are the outer loop: round 1 of every point, then round 2
    assert [p.key for p in repeated] == [
        "strategy=ddp_topology=1x2_run=1of2",
        "strategy=zero2_topology=1x2_run=1of2",
        "strategy=ddp_topology=1x2_run=2of2",
        "strategy=zero2_topology=1x2_run=2of2",
    ]
    assert repeated[0].overrides == repeated[2].overrides
    with pytest.raises(ConfigError, match="no axis 'nodes'"):
        matches(two, ["nodes=2"])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"matrix": {"strategy": ["zero9"]}}, "no preset named 'zero9'"),
        ({"matrix": {"topology": ["2by2"]}}, "topology '2by2' is not NODESxRANKS"),
        ({"launcher": "mpirun"}, "launcher"),
        ({"matrixx": {}}, "matrixx: unknown key"),
    ],
)
def test_bad_studies_are_refused(tmp_path, capsys, change, message):
    path = write_study(tmp_path, **change)
    assert main(["sweep", str(path), "--out", str(tmp_path / "runs")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # the slow tier (make test-slow)
def test_a_sweep_runs_every_point_goes_on_past_a_failure_and_resumes(tmp_path, capsys):
    # fsdp2's CPU offload is refused on CPUs: that point fails, the others still run.
    offload = tmp_path / "offload.yaml"
    offload.write_text("name: fsdp2\ncpu_offload: true\n")
    path = write_study(
        tmp_path,
        matrix={"strategy": ["ddp", str(offload), "zero2"], "topology": ["1x2"]},
        include=[{"strategy": "single", "topology": "1x1"}, {"strategy": "ddp", "topology": "1x1"}],
    )
    out = tmp_path / "runs"
    assert main(["sweep", str(path), "--out", str(out)]) == 1  # a failed point makes the exit code non-zero
    text = capsys.readouterr().out
    assert "sweep: 4 ok, 1 failed" in text
    assert "CPUOffloadPolicy" in text and "next: kanscale analyze" in text and "| zero2" in text
    records = [read_summary(p) for p in out.glob("*/summary.json")]
    # the same experiment on 1 and on 2 ranks is two points, both run
    assert sorted((r.strategy.name, r.topology.world_size) for r in records) == [
        ("ddp", 1),
        ("ddp", 2),
        ("deepspeed", 2),
        ("single", 1),
    ]
    assert {r.study for r in records} == {"tiny"} and all(r.status == "ok" for r in records)
    log = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in log].count("failed") == 1

    assert main(["sweep", str(path), "--out", str(out), "--resume", "--only", "strategy=zero2"]) == 0
    assert "1 skipped" in capsys.readouterr().out
    assert len(list(out.glob("*/summary.json"))) == 4  # nothing ran again


def test_slurm_presets_write_one_script_per_point(tmp_path, capsys):
    out = tmp_path / "runs"
    assert (
        main(
            [
                "sweep",
                str(ROOT / "configs/studies/model_size_paper.yaml"),
                "--out",
                str(out),
                "--only",
                "strategy=zero3",
            ]
        )
        == 0
    )
    scripts = sorted((out / "slurm").glob("*.sbatch"))
    assert len(scripts) == 4  # one per model width
    assert "4 sbatch script(s)" in capsys.readouterr().out
    assert all("#SBATCH --nodes=2" in s.read_text() and "#SBATCH --gpus-per-node=2" in s.read_text() for s in scripts)


def test_a_sweeps_set_lines_reach_every_point_and_a_misspelled_key_is_refused_first(tmp_path, capsys):
    """``kanscale sweep --set``: applied to every point after the study's own settings; a key the
    experiment does not have is refused before any point is planned."""
    study = str(ROOT / "configs/studies/strong_cpu.yaml")
    assert main(["sweep", study, "--out", str(tmp_path), "--set", "training.stepz=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--set (point " in err and "training.stepz: unknown key; did you mean 'steps'?" in err
    assert main(["sweep", study, "--out", str(tmp_path), "--set", "training.steps=30", "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "launchers.cli train" in line]
    assert len(commands) == len(expand(load_study(study))[0])
    assert all(
        line.index("training.epochs=1") < line.index("--set training.steps=30") for line in commands
    )  # after the study's


def test_set_is_checked_with_each_points_axes_so_a_study_that_leaves_the_batch_to_its_axes_takes_it(tmp_path, capsys):
    """demo_cpu.yaml sets micro_batch: null and gives each size its global_batch on an axis: the
    --set check once read the study's set: without the axes and refused the help's own example."""
    study = str(ROOT / "configs/studies/demo_cpu.yaml")
    assert main(["sweep", study, "--out", str(tmp_path), "--set", "training.steps=20", "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "launchers.cli train" in line]
    assert len(commands) == len(expand(load_study(study))[0]) and all("training.steps=20" in c for c in commands)
    assert main(["sweep", study, "--out", str(tmp_path), "--set", "model.impl=fusd", "--dry-run"]) == 2
    assert "--set (point size=study" in capsys.readouterr().err


def two_point_study(tmp_path: Path) -> Path:
    """Two one-process points of a few steps each."""
    return write_study(
        tmp_path,
        set={"training.steps": 6, "training.epochs": None, "training.micro_batch": 64, "measurement.baseline_steps": 1},
        matrix={"strategy": ["single"], "topology": ["1x1"], "training.lr": [0.01, 0.02]},
        include=[],
    )


def test_a_second_sweep_on_an_output_directory_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "runs"
    held = SweepLock.acquire(out)  # another sweep's hold (flock: another open file, as another process has)
    try:
        err = refused(["sweep", str(two_point_study(tmp_path)), "--out", str(out)], capsys)
    finally:
        held.release()
    assert f"{out} is in use by another sweep (pid {os.getpid()} on " in err and "started 20" in err
    assert "or give another --out" in err
    assert sorted(p.name for p in out.iterdir()) == [".sweep.lock"]  # nothing run, logged or set aside


def test_a_points_run_is_the_record_of_its_own_experiment_not_the_first_new_one(tmp_path):
    from launchers.launch.request import RunRequest
    from launchers.studies.point import outcome, run_key
    from launchers.studies.study import Point

    out = tmp_path / "runs"
    # a run of another experiment that appeared while the point ran, first by name, and the point's own
    write_record(out, make_record("a-foreign").model_copy(update={"config_digest": "f" * 16}))
    write_record(out, make_record("b-mine").model_copy(update={"config_digest": "m" * 16}))
    point = Point(axes={}, strategy="single", nodes=1, procs_per_node=1, overrides=[])
    result = outcome(
        point,
        run_key("m" * 16, 1, 1),
        out,
        RunRequest(config=str(QUICKSTART), out=str(out)),
        out / "point.log",
        set(),
        time.monotonic(),
        code=0,
    )
    assert (result.status, result.run_id) == ("ok", "b-mine")


def wait_for_the_lock(out: Path, sweep: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``sweep`` holds OUT's lock: its lock file names it, which it writes once it holds it."""
    deadline = time.monotonic() + timeout
    lock = out / SweepLock.FILE
    while not (lock.exists() and f'"pid": {sweep.pid},' in lock.read_text()):
        assert sweep.poll() is None, f"the sweep ended before it held {lock}: {sweep.communicate()[1]}"
        assert time.monotonic() < deadline, f"the sweep did not take {lock} in {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow  # two real sweeps, one of them a real run of two points
def test_two_sweeps_started_together_one_runs_every_point_the_other_is_refused(tmp_path):
    study, out = two_point_study(tmp_path), tmp_path / "runs"
    command = [sys.executable, "-m", "launchers.cli", "sweep", str(study), "--out", str(out)]
    first = subprocess.Popen(
        command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_the_lock(out, first)
    second = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and f"{out} is in use by another sweep (pid {first.pid} on " in second.stderr
    entries = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    runs = sorted(p.parent.name for p in out.glob("*/summary.json"))
    assert len(entries) == 2 and sorted(e["run_id"] for e in entries) == runs  # one run per point, each its own


@pytest.mark.parametrize(
    "matrix, include, expected",
    [
        ("{strategy: [single, single]}", "[]", "matrix: axis strategy gives 'single' twice; .* set repeats: N"),
        ("{model.widths: [[2, 8, 1], [2, 8, 1]]}", "[]", r"axis model.widths gives \[2, 8, 1\] twice"),
        (
            "{task.n_train: [64, '64']}",
            "[]",
            "axis task.n_train gives 64 and '64', which both name the point n_train=64",
        ),
        (
            "{strategy: [single, ddp], topology: [1x1, 1x2]}",
            "[{topology: 1x2, strategy: ddp}]",
            r"include\[0\] \(topology=1x2_strategy=ddp\) is already a point of the matrix .* set repeats: N",
        ),
    ],
)
def test_a_point_given_twice_is_refused_naming_the_axis(tmp_path, matrix, include, expected):
    study = tmp_path / "twice.yaml"
    study.write_text(f"study: twice\nexperiment: quickstart\nmatrix: {matrix}\ninclude: {include}\n")
    with pytest.raises(ConfigError, match=expected):
        load_study(study)
