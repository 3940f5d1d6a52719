"""Where a run lives is not what it is: a run directory moved elsewhere resumes (by ``--resume DIR``,
and by ``--resume`` alone under its new output.dir), a run started by an earlier kanscale, whose
digest also took in output.dir, resumes by its config.yaml, and a resume with a different
experiment names every field that differs."""

import json
import shutil

import pytest
import yaml

from analysis.records.run_files import SUMMARY_FILE
from kanscale.errors import ConfigError
from launchers.cli import main
from strategies.experiment import parse_experiment
from strategies.loop.trainer import find_resumable
from tests.helpers.launch import run_here
from tests.helpers.runs import failed_run, losses, small


@pytest.fixture
def moved(tmp_path):
    """A run that failed at step 11 (checkpoints at 6 and 9), moved to another directory."""
    run_dir = failed_run(small(tmp_path / "runs"))
    moved = tmp_path / "elsewhere" / run_dir.name
    moved.parent.mkdir()
    shutil.move(run_dir, moved)
    return moved


def test_a_moved_run_resumes_from_where_it_now_is(tmp_path, moved, capsys):
    full = run_here(small(tmp_path / "full"))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small(tmp_path / "other")))  # neither where it was started nor where it is
    assert main(["train", str(config), "--resume", str(moved), "--no-progress"]) == 0, capsys.readouterr().err
    assert losses(moved) == [s.loss for s in full.combined]
    assert json.loads((moved / SUMMARY_FILE).read_text())["resumed_at_steps"] == [9]


def test_resume_alone_finds_a_moved_run_under_its_new_output_dir(moved):
    assert find_resumable(parse_experiment(small(moved.parent)), 1) == moved


def test_a_run_whose_digest_an_earlier_kanscale_took_resumes_by_its_config(tmp_path, moved):
    summary = json.loads((moved / SUMMARY_FILE).read_text())
    (moved / SUMMARY_FILE).write_text(json.dumps({**summary, "config_digest": "0123456789abcdef"}))
    assert run_here(small(tmp_path / "runs"), resume=moved).record.resumed_at_steps == [9]


def test_a_different_experiment_is_refused_with_every_field_that_differs(tmp_path, moved):
    other = small(tmp_path / "runs", lr=0.05)
    other["model"]["grid"] = 4
    before = (moved / SUMMARY_FILE).read_bytes()
    with pytest.raises(ConfigError) as refused:
        run_here(other, resume=moved)
    message = str(refused.value)
    assert f"--resume: {moved} is a different experiment" in message
    assert "model.grid: 3 in the run, 4 now" in message and "training.lr: 0.02 in the run, 0.05 now" in message
    assert "output.dir" not in message
    assert (moved / SUMMARY_FILE).read_bytes() == before
