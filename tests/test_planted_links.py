"""Never write through a link someone else planted: a report, a JSON document, a schema, a SLURM
script is written beside its name and renamed over it, so a symbolic link planted at that name
is replaced, and the file it pointed to is untouched; a file appended to (a sweep's log, a run's
steps) refuses a link at its name, naming it."""

from pathlib import Path

import pytest
import yaml

from launchers.cli import main
from tests.helpers.launch import ROOT

SHORT = ["--strategy", "single", "--set", "training.steps=2", "--set", "training.warmup_steps=1", "--no-progress"]


def plant(at: Path, outside: Path) -> None:
    """A link at ``at`` to ``outside``, a file holding 'keep'."""
    outside.write_text("keep")
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(outside)


def assert_replaced(at: Path, outside: Path) -> None:
    assert outside.read_text() == "keep", f"{outside} was written through {at}"
    assert at.is_file() and not at.is_symlink() and at.read_text() != "keep"


def test_analyze_replaces_links_planted_in_its_report_folder(tmp_path):
    runs = tmp_path / "runs"
    assert main(["train", "quickstart", *SHORT, "--out", str(runs)]) == 0
    names = ["verdict.md", "verdict.csv", "report.html"]
    for i, name in enumerate(names):
        plant(runs / "report" / name, tmp_path / f"outside{i}")
    assert main(["analyze", str(runs)]) == 0
    for i, name in enumerate(names):
        assert_replaced(runs / "report" / name, tmp_path / f"outside{i}")


@pytest.mark.parametrize("command", ["schema", "project"])
def test_a_document_written_where_a_link_was_planted_replaces_the_link(tmp_path, command):
    out = tmp_path / "doc.json"
    plant(out, tmp_path / "outside.json")
    plant(out.with_suffix(".md"), tmp_path / "outside.md")
    if command == "schema":
        assert main(["schema", "--out", str(out)]) == 0
    else:  # a JSON document and its Markdown twin, as recommend, rehearse and project write them
        cluster = str(ROOT / "configs/clusters/a100_ib.yaml")
        assert main(["project", "--profile", "paper", "--cluster", cluster, "--out", str(out)]) == 0
        assert_replaced(out.with_suffix(".md"), tmp_path / "outside.md")
    assert_replaced(out, tmp_path / "outside.json")


def test_a_sweep_log_that_is_a_link_is_refused_by_name(tmp_path, capsys):
    study = tmp_path / "tiny.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "study": "tiny",
                "preset": "cpu",
                "experiment": str(ROOT / "configs/experiments/quickstart.yaml"),
                "set": {"training.steps": 2, "training.warmup_steps": 1, "measurement.baseline_steps": 1},
                "matrix": {"strategy": ["single"], "topology": ["1x1"]},
            }
        )
    )
    out = tmp_path / "runs"
    plant(out / "sweep.jsonl", tmp_path / "outside.jsonl")
    main(["sweep", str(study), "--out", str(out)])
    err = capsys.readouterr().err
    assert f"{out / 'sweep.jsonl'} is a symbolic link; kanscale does not write through a link" in err
    assert (tmp_path / "outside.jsonl").read_text() == "keep"
